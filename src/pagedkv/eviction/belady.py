"""Eviction policy `belady`: the offline optimum (Belady's MIN) for prefix caching, in replay.

The future is known in replay: a `FutureOracle` says when each block hash is next *used*
(appears within a later request's hittable prefix). The victim is the free cached leaf whose
next use is furthest away (never used again first), the deeper one on a tie. A child is used
whenever its parent is (its prefix contains the parent's), so its next use is never sooner:
evicting furthest-first, deepest-first keeps every chain intact, and leaves-only makes that a
guarantee. A duplicate of a cached hash can never be hit and goes first. O(log n) per
operation (a heap with lazy deletion); replay only, never on a serving hot path.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction.base import EvictionPolicy
from pagedkv.eviction.prefix_links import PrefixLinks
from pagedkv.free_queue import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels

NEVER = 1 << 62
"""`FutureOracle.next_use` of a hash that is not used again."""


class FutureOracle(Protocol):
    """When each block hash is next used, as the replay advances."""

    def next_use(self, block_hash: BlockHash) -> int:
        """The index of the next request that can hit `block_hash` (NEVER if none)."""
        ...


class BeladyPolicy(EvictionPolicy):
    """Furthest next use first, among free cached leaves.

    Invariants: a free cached block is a heap entry (its live stamp) iff it is a leaf, else in
    `_blocked`; stale heap entries (stamp mismatch) are skipped when popped.
    """

    name = "belady"

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        retention: RetentionLevels | None = None,
        oracle: FutureOracle | None = None,
    ) -> None:
        if oracle is None:
            raise ConfigError(
                "eviction policy 'belady' needs a FutureOracle: it knows the future, so it "
                "runs in replay only (pagedkv simulate --mode replay --eviction belady)"
            )
        super().__init__(blocks, retention)
        self.oracle = oracle
        self.links = PrefixLinks(self.num_blocks)
        self._end_token = [0] * self.num_blocks
        self._heap: list[tuple[int, int, int, int]] = []
        self._stamp = [0] * self.num_blocks  # 0: not in the heap
        self._next_stamp = 1
        self._blocked = FreeKVCacheBlockQueue(())
        self._is_blocked = bytearray(self.num_blocks)
        self.num_heap_blocks = 0

    def note_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None, end_token: int) -> None:
        self._end_token[block.block_id] = end_token
        self.links.link(block, parent)

    def _next_use(self, block: KVCacheBlock) -> int:
        block_hash = block.block_hash
        assert block_hash is not None
        if self.hash_maps and self.hash_maps[block.hash_group_id].get(block_hash) is not block:
            return NEVER  # a duplicate: lookups return the first block cached under its hash
        return self.oracle.next_use(block_hash)

    def _push(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        stamp = self._next_stamp
        self._next_stamp = stamp + 1
        self._stamp[block_id] = stamp
        heapq.heappush(
            self._heap, (-self._next_use(block), -self._end_token[block_id], stamp, block_id)
        )
        self.num_heap_blocks += 1

    def _insert_cached(self, block: KVCacheBlock) -> None:
        if self.links.num_children[block.block_id]:
            self._blocked.append(block)
            self._is_blocked[block.block_id] = 1
        else:
            self._push(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        if self._is_blocked[block_id]:
            self._blocked.remove(block)
            self._is_blocked[block_id] = 0
        else:
            self._stamp[block_id] = 0  # its heap entry goes stale
            self.num_heap_blocks -= 1
        if len(self._heap) > 2 * self.num_heap_blocks + 1024:
            self._compact()

    def _pop_victim(self) -> KVCacheBlock:
        heap, stamps = self._heap, self._stamp
        block: KVCacheBlock | None = None
        while heap:
            _, _, stamp, block_id = heapq.heappop(heap)
            if stamps[block_id] == stamp:
                stamps[block_id] = 0
                self.num_heap_blocks -= 1
                block = self.blocks[block_id]
                break
        if block is None:
            # Every free cached block has a held child (a window freed the parent): see
            # `cost` for why the pool must still be able to hand it out.
            block = self._blocked.popleft()
            self._is_blocked[block.block_id] = 0
        self._forget(block)
        return block

    def _forget(self, block: KVCacheBlock) -> None:
        parent_id = self.links.unlink(block)
        if parent_id >= 0 and self._is_blocked[parent_id]:
            parent = self.blocks[parent_id]
            self._blocked.remove(parent)
            self._is_blocked[parent_id] = 0
            self._push(parent)

    def _compact(self) -> None:
        """Drop stale entries (each free leaf keeps exactly one live entry)."""
        stamps = self._stamp
        self._heap = [entry for entry in self._heap if stamps[entry[3]] == entry[2]]
        heapq.heapify(self._heap)

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        """Free leaves in eviction order (keys as of when each was freed), then the blocked
        parents (which join as their children go)."""
        stamps = self._stamp
        for entry in sorted(self._heap):
            if stamps[entry[3]] == entry[2]:
                yield self.blocks[entry[3]]
        yield from self._blocked

    def _clear(self) -> None:
        self.links.clear()
        self._heap = []
        self._stamp = [0] * self.num_blocks
        self._blocked = FreeKVCacheBlockQueue(())
        self._is_blocked = bytearray(self.num_blocks)
        self.num_heap_blocks = 0

    def _check(self) -> None:
        self._blocked.check_invariants()
        self.links.check_invariants(list(self.blocks))
        live = [entry for entry in self._heap if self._stamp[entry[3]] == entry[2]]
        if len(live) != self.num_heap_blocks or len({entry[3] for entry in live}) != len(live):
            raise InvariantViolation("belady: heap entries and num_heap_blocks disagree")
        for entry in live:
            if not self.links.is_leaf(self.blocks[entry[3]]):
                raise InvariantViolation(f"belady: block {entry[3]} in the heap has a child")
        for block in self._blocked:
            if self.links.is_leaf(block):
                raise InvariantViolation(f"belady: blocked block {block.block_id} is a leaf")
