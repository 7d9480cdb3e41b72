"""Eviction policy `lru` in policy form: the pool's plain free queue order, as an object.

Used only when retention is on (plain LRU needs no policy object: the pool's own free queue is
the order, and stays bit-for-bit the reference's). Same victims as the plain queue; a block
uncached by `evict_blocks` moves to the unhashed queue instead of keeping its place.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.eviction.base import EvictionPolicy
from pagedkv.free_queue import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels


class LRUPolicy(EvictionPolicy):
    """Least recently freed first. Invariant: `_queue` holds the policy's blocks, oldest first."""

    name = "lru"

    def __init__(
        self, blocks: Sequence[KVCacheBlock], retention: RetentionLevels | None = None
    ) -> None:
        super().__init__(blocks, retention)
        self._queue = FreeKVCacheBlockQueue(())

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        """Hot path: no per-block state when a block is cached."""

    def _insert_cached(self, block: KVCacheBlock) -> None:
        self._queue.append(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        self._queue.remove(block)

    def _pop_victim(self) -> KVCacheBlock:
        return self._queue.popleft()

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        queue = self._queue
        before = queue.num_free_blocks
        queue.append_n(blocks)
        return queue.num_free_blocks - before

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        out.extend(self._queue.popleft_n(num_victims))

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        return iter(self._queue)

    def _clear(self) -> None:
        self._queue = FreeKVCacheBlockQueue(())

    def _check(self) -> None:
        self._queue.check_invariants()
