"""Block pool layer, checks: a pool's constructor arguments and its invariants.

Functions of the values and structures they are given (the pool passes its own); they change
nothing and are never on a hot path. Knows no `BlockPool` class.
"""

from __future__ import annotations

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool.entries import check_extra_keys
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction import EvictionConfig, FreeBlockSet, HostTier
from pagedkv.memory_guard import BYTES_PER_POOL_BLOCK, check_fits


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
    check_fits(f"a pool of {num_blocks:,} blocks", num_blocks * BYTES_PER_POOL_BLOCK)
    if not isinstance(num_hash_lookahead_tokens, int) or num_hash_lookahead_tokens < 0:
        raise ConfigError(
            f"num_hash_lookahead_tokens must be an int >= 0, got {num_hash_lookahead_tokens!r}"
        )
    if eviction.host_num_blocks and num_kv_cache_groups > 1:
        raise ConfigError(
            f"the host-memory tier supports one KV-cache group, not {num_kv_cache_groups}"
        )


def check_pool_invariants(
    blocks: list[KVCacheBlock],
    null_block: KVCacheBlock,
    free_blocks: FreeBlockSet,
    host_tier: HostTier | None,
    hash_to_block: list[dict[BlockHash, KVCacheBlock]],
    duplicates: list[dict[BlockHash, dict[int, KVCacheBlock]]],
    extra_block_hashes: dict[int, list[BlockHash]],
    enable_caching: bool,
) -> None:
    """Verify a pool's invariants (`BlockPool`'s docstring) on its parts; raise
    `InvariantViolation` on the first broken one."""
    free_blocks.check_invariants()
    if host_tier is not None:
        host_tier.check_invariants()
    if blocks[0] is not null_block:
        raise InvariantViolation("block 0 is not the null block")
    if null_block.prev_free_block is not None or null_block.next_free_block is not None:
        raise InvariantViolation("the null block is linked in the free queue")
    if null_block.block_hash is not None:
        raise InvariantViolation("the null block has a hash")
    linked = {id(b) for b in free_blocks}
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
            if not enable_caching:
                raise InvariantViolation(f"block {block_id} hashed with caching disabled")
            group = block.hash_group_id
            in_map = hash_to_block[group].get(block.block_hash) is block or (
                duplicates[group].get(block.block_hash, {}).get(block_id) is block
            )
            if not in_map:
                raise InvariantViolation(f"block {block_id} has a hash but no map entry")
    for group_id, hash_map in enumerate(hash_to_block):
        _check_hash_map(group_id, hash_map, duplicates[group_id], extra_block_hashes)
    check_extra_keys(hash_to_block, duplicates, extra_block_hashes, blocks)


def _check_hash_map(
    group_id: int,
    hash_map: dict[BlockHash, KVCacheBlock],
    duplicates: dict[BlockHash, dict[int, KVCacheBlock]],
    extra_block_hashes: dict[int, list[BlockHash]],
) -> None:
    """Every entry of one group's map, and of its duplicates, points at a block of that group
    with that hash (its primary one or a further key)."""

    def has_key(block: KVCacheBlock, block_hash: BlockHash) -> bool:
        return block.block_hash == block_hash or block_hash in extra_block_hashes.get(
            block.block_id, ()
        )

    for block_hash, block in hash_map.items():
        if not has_key(block, block_hash) or block.hash_group_id != group_id:
            raise InvariantViolation(
                f"map entry of group {group_id} points at block {block.block_id} whose hash differs"
            )
    for block_hash, others in duplicates.items():
        if block_hash not in hash_map or not others:
            raise InvariantViolation("duplicate entry without a primary entry")
        for block_id, block in others.items():
            if block.block_id != block_id or not has_key(block, block_hash):
                raise InvariantViolation(f"stale duplicate entry for block {block_id}")
