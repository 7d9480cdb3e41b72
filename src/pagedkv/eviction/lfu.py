"""Eviction policy `lfu`: least frequently used with dynamic aging (LFU-DA), in O(1).

A cached block's key is `age + value` (value: its access count, capped); the victim is the
lowest key, least recently freed among equals, and each victim's key becomes the new age, so
old popularity counts for less as the cache turns over (Arlitt et al., "Evaluating content
management techniques for Web proxy caches", 2000). Every live key lies in
`[age, age + max_value]`, so keys live in a ring of `max_value + 1` FIFO buckets: O(1) insert
and remove, and the victim search scans at most the ring.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.errors import InvariantViolation
from pagedkv.eviction.base import EvictionPolicy
from pagedkv.free_queue import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels

MAX_ACCESS_COUNT = 64
"""Accesses counted per block (a saturating counter: one byte a block)."""


class LFUPolicy(EvictionPolicy):
    """Lowest `age + value` first; FIFO (least recently freed) among equal keys.

    Invariants: every block in the ring has its key in `[age, age + max_value]` and sits in
    bucket `key % ring_size`; `age` never decreases; `num_ring_blocks` counts the ring.
    """

    name = "lfu"

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        retention: RetentionLevels | None = None,
        max_value: int = MAX_ACCESS_COUNT,
    ) -> None:
        super().__init__(blocks, retention)
        self._access_count = bytearray(self.num_blocks)
        self._key = [0] * self.num_blocks
        self._max_value = max_value
        self._ring_size = max_value + 1
        self._ring = [FreeKVCacheBlockQueue(()) for _ in range(self._ring_size)]
        self.num_ring_blocks = 0
        self.age = 0

    def _value(self, block: KVCacheBlock) -> int:
        return self._access_count[block.block_id]

    def note_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None, end_token: int) -> None:
        self._access_count[block.block_id] = 1

    def note_hit(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        count = self._access_count[block_id]
        if count < MAX_ACCESS_COUNT:
            self._access_count[block_id] = count + 1

    def _insert_cached(self, block: KVCacheBlock) -> None:
        value = self._value(block)
        key = self.age + (value if value < self._max_value else self._max_value)
        self._key[block.block_id] = key
        self._ring[key % self._ring_size].append(block)
        self.num_ring_blocks += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        self._ring[self._key[block.block_id] % self._ring_size].remove(block)
        self.num_ring_blocks -= 1

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        counts = self._access_count
        for index in range(start, end):
            block = blocks[index]
            if skipped_ids is None or id(block) not in skipped_ids:
                counts[block.block_id] = 1

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        # Hot path: `_insert_cached` inlined; a request's blocks mostly share one key, so runs
        # of equal keys go to their bucket in one call.
        ring, ring_size, key_of = self._ring, self._ring_size, self._key
        counts, age, max_value = self._access_count, self.age, self._max_value
        num_blocks = 0
        run: list[KVCacheBlock] = []
        run_key = -1
        for block in blocks:
            block_id = block.block_id
            value = counts[block_id]
            key = age + (value if value < max_value else max_value)
            key_of[block_id] = key
            if key != run_key:
                if run:
                    ring[run_key % ring_size].append_n(run)
                    num_blocks += len(run)
                run = [block]
                run_key = key
            else:
                run.append(block)
        if run:
            ring[run_key % ring_size].append_n(run)
            num_blocks += len(run)
        self.num_ring_blocks += num_blocks
        return num_blocks

    def take_hits(self, blocks: Sequence[KVCacheBlock], null_block: KVCacheBlock) -> None:
        if self._guarded:
            super().take_hits(blocks, null_block)
            return
        # Hot path: `remove` / `on_hit_held` inlined (a lookup's hits are adopted together).
        ring, ring_size, key_of = self._ring, self._ring_size, self._key
        counts = self._access_count
        unhashed_remove = self._unhashed.remove
        num_unhashed = num_ring = 0
        for block in blocks:
            if block is null_block:
                continue
            block_id = block.block_id
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed_remove(block)
                    num_unhashed += 1
                    block.ref_cnt = 1
                    continue
                ring[key_of[block_id] % ring_size].remove(block)
                num_ring += 1
            count = counts[block_id]
            if count < MAX_ACCESS_COUNT:
                counts[block_id] = count + 1
            block.ref_cnt += 1
        self.num_ring_blocks -= num_ring
        self.num_policy_blocks -= num_ring
        self.num_free_blocks -= num_ring + num_unhashed

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        # Hot path: the lowest buckets are taken whole (the key only moves up meanwhile); a
        # victim's count is left as is: `note_cached` sets it when the block is cached again.
        if num_victims > self.num_ring_blocks:
            raise InvariantViolation(f"{self.name}: {num_victims} victims wanted from the ring")
        ring, ring_size = self._ring, self._ring_size
        key = self.age
        num_left = num_victims
        while num_left:
            queue = ring[key % ring_size]
            num_taken = queue.num_free_blocks
            if not num_taken:
                key += 1
                continue
            if num_taken > num_left:
                num_taken = num_left
            out += queue.popleft_n(num_taken)
            num_left -= num_taken
        self.age = key
        self.num_ring_blocks -= num_victims

    def _pop_ring(self) -> KVCacheBlock:
        """Unlink the ring's lowest key (FIFO among equals) and make its key the age."""
        ring, ring_size = self._ring, self._ring_size
        key = self.age
        for _ in range(ring_size):
            queue = ring[key % ring_size]
            if queue.num_free_blocks:
                self.age = key
                self.num_ring_blocks -= 1
                return queue.popleft()
            key += 1
        raise InvariantViolation(f"{self.name}: no block in the ring")

    def _pop_victim(self) -> KVCacheBlock:
        block = self._pop_ring()
        self._access_count[block.block_id] = 0
        return block

    def _forget(self, block: KVCacheBlock) -> None:
        self._access_count[block.block_id] = 0

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        """Exact eviction order: ascending key, FIFO within a key."""
        for key in range(self.age, self.age + self._ring_size):
            yield from self._ring[key % self._ring_size]

    def _clear(self) -> None:
        self._ring = [FreeKVCacheBlockQueue(()) for _ in range(self._ring_size)]
        self._access_count = bytearray(self.num_blocks)
        self.num_ring_blocks = 0

    def _check(self) -> None:
        num_ring_blocks = 0
        for bucket, queue in enumerate(self._ring):
            queue.check_invariants()
            for block in queue:
                key = self._key[block.block_id]
                if key % self._ring_size != bucket or not (
                    self.age <= key <= self.age + self._max_value
                ):
                    raise InvariantViolation(
                        f"{self.name}: block {block.block_id} key {key} in bucket {bucket}, "
                        f"age {self.age}"
                    )
                num_ring_blocks += 1
        if num_ring_blocks != self.num_ring_blocks:
            raise InvariantViolation(f"{self.name}: ring count {self.num_ring_blocks} is wrong")
