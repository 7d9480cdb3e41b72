"""Block pool layer, general paths: the twins of `BlockPool`'s hot methods for the less common
cases (an eviction policy, metrics or a host tier, duplicate hashes, a double free).

The hot methods keep the common case inline in the pool and call these for the rest. Functions
of the pool's parts, each with exactly its hot twin's result (block ids, free order, events).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.errors import InvalidArgumentError, InvariantViolation
from pagedkv.eviction import EvictionPolicy, FreeBlockSet, HostTier

if TYPE_CHECKING:
    from pagedkv.events import KVCacheEvent


class BlockResidencyObserver(Protocol):
    """Hooks for sampled block-residency metrics (see `pagedkv.metrics.residency`); the pool
    re-exports it (`pagedkv.block_pool.BlockResidencyObserver`)."""

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...
    def on_block_accessed(self, block: KVCacheBlock) -> None: ...
    def on_block_evicted(self, block: KVCacheBlock) -> None: ...
    def reset(self) -> None: ...


def free_blocks_to_policy(
    policy: FreeBlockSet, null_block: KVCacheBlock, ordered_blocks: Sequence[KVCacheBlock]
) -> None:
    """`BlockPool.free_blocks` with an eviction policy: the blocks reaching zero go to the policy
    in two runs (unhashed ones to be reused first, hashed ones in the order given). A double
    free raises `InvalidArgumentError` with every reference given back."""
    to_head: list[KVCacheBlock] = []
    to_tail: list[KVCacheBlock] = []
    for index, block in enumerate(ordered_blocks):
        if block is null_block:
            continue
        ref_cnt = block.ref_cnt - 1
        if ref_cnt > 0:
            block.ref_cnt = ref_cnt
        elif ref_cnt == 0:
            block.ref_cnt = 0
            if block.block_hash is None:
                to_head.append(block)
            else:
                to_tail.append(block)
        else:
            for freed in ordered_blocks[:index]:
                if freed is not null_block:
                    freed.ref_cnt += 1
            raise InvalidArgumentError(
                f"free_blocks: block {block.block_id} is already free (ref_cnt 0); "
                "were these blocks freed twice?"
            )
    if to_head:
        policy.prepend_n(to_head)
    if to_tail:
        policy.append_n(to_tail)


def undo_free(
    done: Sequence[KVCacheBlock],
    old_last: KVCacheBlock,
    tail: KVCacheBlock,
    head_chain: KVCacheBlock,
    null_block: KVCacheBlock,
) -> None:
    """Give back the references the plain queue's `free_blocks` dropped from `done` and unlink
    what it linked: the blocks after `old_last` (the tail before the call) and the side chain
    hanging from `head_chain`, which was not spliced in yet."""
    old_last.next_free_block = tail
    tail.prev_free_block = old_last
    head_chain.next_free_block = None
    for block in done:
        if block is null_block:
            continue
        block.ref_cnt += 1
        if block.ref_cnt == 1:  # it had reached zero and was linked
            block.prev_free_block = block.next_free_block = None


def evict_for_reuse(
    blocks: Sequence[KVCacheBlock],
    evict: Callable[[KVCacheBlock], bool],
    host: HostTier | None,
    events: list[KVCacheEvent] | None,
) -> None:
    """`BlockPool.get_new_blocks` with metrics on or a host tier: drop the cache entries of the
    blocks popped for reuse through `evict` (the pool's general eviction), demote them to the
    host tier, and take a reference on each."""
    for block in blocks:
        block_hash = block.block_hash
        if block_hash is not None:
            group_id = block.hash_group_id
            evict(block)
            if host is not None:
                host.demote(block_hash, group_id, events)
        block.ref_cnt = 1


def touch_with_policy(
    blocks: Sequence[KVCacheBlock],
    policy: EvictionPolicy,
    null_block: KVCacheBlock,
    collector: BlockResidencyObserver | None,
) -> None:
    """`BlockPool.touch` with an eviction policy, which also hears of hits on blocks other
    requests hold (and adds the reference to each block)."""
    policy.take_hits(blocks, null_block)
    if collector is not None:
        for block in blocks:
            if block is not null_block:
                collector.on_block_accessed(block)


def drop_entry_with_duplicates(
    hash_map: dict[BlockHash, KVCacheBlock],
    duplicates: dict[BlockHash, dict[int, KVCacheBlock]],
    block: KVCacheBlock,
    block_hash: BlockHash,
) -> None:
    """Remove `block` from one group's hash map when the group has duplicate hashes: a primary
    entry hands over to the earliest remaining duplicate (lookups keep "first cached wins"), a
    duplicate just leaves. Raise `InvariantViolation` if the block is in neither."""
    if hash_map.get(block_hash) is block:
        others = duplicates.get(block_hash)
        if others:
            promoted_id = next(iter(others))
            hash_map[block_hash] = others.pop(promoted_id)
            if not others:
                del duplicates[block_hash]
        else:
            del hash_map[block_hash]
        return
    others = duplicates.get(block_hash)
    if others is None or others.pop(block.block_id, None) is None:
        raise InvariantViolation(f"block {block.block_id} has a hash but is not in the hash map")
    if not others:
        del duplicates[block_hash]
