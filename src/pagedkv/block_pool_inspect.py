"""Block pool layer, inspection: the read-only half of `BlockPool` and its argument checks.

`BlockPoolInspection` (a base of `BlockPool`) counts, lists and verifies a pool's blocks, hash
maps, eviction policy and host tier; nothing here changes the pool. Kept apart from the
allocation and caching paths so those stay short; nothing here is on a hot path.
"""

from __future__ import annotations

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction import (
    EvictionConfig,
    EvictionPolicy,
    EvictionStats,
    FreeBlockSet,
    HostTier,
)
from pagedkv.host_memory import BYTES_PER_BLOCK, check_fits


def check_pool_args(
    num_blocks: int,
    hash_block_size: int,
    num_kv_cache_groups: int,
    num_hash_lookahead_tokens: int,
    eviction: EvictionConfig,
) -> None:
    """Raise `ConfigError` (or `MemoryLimitError`) naming the first bad argument of a pool."""
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
        raise ConfigError(
            f"num_blocks={num_blocks!r}: a pool needs at least 2 blocks (block 0 is the null block)"
        )
    if not isinstance(hash_block_size, int) or hash_block_size <= 0:
        raise ConfigError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
    if num_kv_cache_groups < 1:
        raise ConfigError(f"num_kv_cache_groups={num_kv_cache_groups} must be >= 1")
    check_fits(f"a pool of {num_blocks:,} blocks", num_blocks * BYTES_PER_BLOCK)
    if not isinstance(num_hash_lookahead_tokens, int) or num_hash_lookahead_tokens < 0:
        raise ConfigError(
            f"num_hash_lookahead_tokens must be an int >= 0, got {num_hash_lookahead_tokens!r}"
        )
    if eviction.host_num_blocks and num_kv_cache_groups > 1:
        raise ConfigError(
            f"the host-memory tier supports one KV-cache group, not {num_kv_cache_groups}"
        )


class BlockPoolInspection:
    """Reads of a `BlockPool` (this class holds no state of its own: the attributes below are
    the pool's, set by `BlockPool.__init__`)."""

    num_gpu_blocks: int
    enable_caching: bool
    blocks: list[KVCacheBlock]
    null_block: KVCacheBlock
    free_block_queue: FreeBlockSet
    eviction_policy: EvictionPolicy | None
    eviction_config: EvictionConfig
    host_tier: HostTier | None
    hash_to_block: list[dict[BlockHash, KVCacheBlock]]
    _duplicates: list[dict[BlockHash, dict[int, KVCacheBlock]]]

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (cached-but-free blocks count as free)."""
        usable = self.num_gpu_blocks - 1
        return 1.0 - self.free_block_queue.num_free_blocks / usable

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head, the next to reuse, first)."""
        return [block.block_id for block in self.free_block_queue]

    def cached_hashes(self, kv_cache_group_id: int = 0) -> dict[BlockHash, list[int]]:
        """Hash → cached block ids (first-cached first) for one group."""
        out = {h: [b.block_id] for h, b in self.hash_to_block[kv_cache_group_id].items()}
        for block_hash, others in self._duplicates[kv_cache_group_id].items():
            out[block_hash].extend(others)
        return out

    def get_eviction_stats(self) -> EvictionStats:
        """The eviction policy's name and the retention and host-tier counters."""
        policy = self.eviction_policy
        retention = policy.retention if policy is not None else None
        host = self.host_tier
        return EvictionStats(
            self.eviction_config.policy,
            retention.num_retained_blocks if retention is not None else 0,
            retention.num_demoted_blocks if retention is not None else 0,
            retention.num_lapsed_blocks if retention is not None else 0,
            len(host) if host is not None else 0,
            host.num_demoted_blocks if host is not None else 0,
            host.num_evicted_blocks if host is not None else 0,
            host.num_promoted_blocks if host is not None else 0,
        )

    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix cache, all groups."""
        return sum(len(m) for m in self.hash_to_block) + sum(
            len(d) for dups in self._duplicates for d in dups.values()
        )

    def check_invariants(self) -> None:
        """Verify the pool's invariants (`BlockPool`'s docstring); raise `InvariantViolation` on
        the first broken one."""
        self.free_block_queue.check_invariants()
        if self.host_tier is not None:
            self.host_tier.check_invariants()
        blocks = self.blocks
        null_block = self.null_block
        hash_to_block = self.hash_to_block
        duplicates = self._duplicates
        if blocks[0] is not null_block:
            raise InvariantViolation("block 0 is not the null block")
        if null_block.prev_free_block is not None or null_block.next_free_block is not None:
            raise InvariantViolation("the null block is linked in the free queue")
        if null_block.block_hash is not None:
            raise InvariantViolation("the null block has a hash")
        linked = {id(b) for b in self.free_block_queue}
        for block_id, block in enumerate(blocks):
            if block.block_id != block_id:
                raise InvariantViolation(f"blocks[{block_id}].block_id == {block.block_id}")
            if block is null_block:
                continue
            if block.ref_cnt < 0:
                raise InvariantViolation(f"block {block_id} has ref_cnt {block.ref_cnt}")
            if (block.ref_cnt == 0) != (id(block) in linked):
                raise InvariantViolation(
                    f"block {block_id}: ref_cnt {block.ref_cnt} but "
                    f"{'in' if id(block) in linked else 'not in'} the free queue"
                )
            if block.block_hash is not None:
                if not self.enable_caching:
                    raise InvariantViolation(f"block {block_id} hashed with caching disabled")
                group = block.hash_group_id
                in_map = hash_to_block[group].get(block.block_hash) is block or (
                    duplicates[group].get(block.block_hash, {}).get(block_id) is block
                )
                if not in_map:
                    raise InvariantViolation(f"block {block_id} has a hash but no map entry")
        for group_id, hash_map in enumerate(hash_to_block):
            _check_hash_map(group_id, hash_map, duplicates[group_id])
        for group_id, hash_map in enumerate(hash_to_block):
            _check_hash_map(group_id, hash_map, duplicates[group_id])


def _check_hash_map(
    group_id: int,
    hash_map: dict[BlockHash, KVCacheBlock],
    duplicates: dict[BlockHash, dict[int, KVCacheBlock]],
) -> None:
    """Every entry of one group's map, and of its duplicates, points at a block with that hash."""
    for block_hash, block in hash_map.items():
        if block.block_hash != block_hash or block.hash_group_id != group_id:
            raise InvariantViolation(
                f"map entry of group {group_id} points at block {block.block_id} whose hash differs"
            )
    for block_hash, others in duplicates.items():
        if block_hash not in hash_map or not others:
            raise InvariantViolation("duplicate entry without a primary entry")
        for block_id, block in others.items():
            if block.block_id != block_id or block.block_hash != block_hash:
                raise InvariantViolation(f"stale duplicate entry for block {block_id}")
