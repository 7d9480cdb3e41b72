"""Eviction policy `continuation`: a finished request's blocks ranked by the chance its session
continues, estimated online (`pagedkv.eviction.sessions`).

When a request frees its blocks, `SessionStats` gives the probability `p` that its session has
a next turn, from counts per class of turn index, prompt length and output length; a preempted
request counts as certain to come back. The blocks' key is `age + value(p)` in `lfu`'s ring
(GreedyDual aging: each victim's key becomes the age), so a likely continuation outlives an
unlikely one freed at the same time, and both fade as the cache turns over. O(1) per block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.eviction.lfu import LFUPolicy
from pagedkv.eviction.sessions import SessionStats
from pagedkv.request import RequestStatus

# Freed while running (or marked preempted): a preemption, the request comes back.
_COMES_BACK = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels
    from pagedkv.request import Request

MAX_VALUE = 64
"""A certain continuation's value; an impossible one's is 1."""


def value_of(probability: float) -> int:
    """The ring value of a continuation probability: 1 .. MAX_VALUE."""
    return 1 + int(probability * (MAX_VALUE - 1) + 0.5)


class ContinuationPolicy(LFUPolicy):
    """Lowest `age + value(p)` first, least recently freed among equals.

    Invariants: `lfu`'s ring invariants; the pending free value is the default outside a
    `note_freeing` / `end_free` pair.
    """

    name = "continuation"
    uses_requests = True

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        retention: RetentionLevels | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(blocks, retention, max_value=MAX_VALUE)
        self.sessions = SessionStats(clock if clock is not None else _zero_clock)
        self._default_value = value_of(0.5)
        self._free_value = self._default_value

    def _note_arrival(self, request: Request) -> None:
        self.sessions.note_arrival(request)

    def note_freeing(self, request: Request) -> None:
        if request.status in _COMES_BACK:
            self._free_value = MAX_VALUE
        else:
            self._free_value = value_of(self.sessions.note_finished(request))

    def end_free(self) -> None:
        self._free_value = self._default_value

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        """Hot path: access counts are not this policy's value; nothing to record."""

    def _value(self, block: KVCacheBlock) -> int:
        return self._free_value

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        # Hot path: every block of one free shares one key, so one bucket takes them all.
        run = blocks if isinstance(blocks, list) else list(blocks)
        if not run:
            return 0
        key = self.age + self._free_value
        key_of = self._key
        for block in run:
            key_of[block.block_id] = key
        self._ring[key % self._ring_size].append_n(run)
        num_blocks = len(run)
        self.num_ring_blocks += num_blocks
        return num_blocks


def _zero_clock() -> float:
    return 0.0
