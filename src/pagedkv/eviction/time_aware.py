"""Eviction policy `hazard`: time-aware; a free block's worth is the chance that its session
still has a next turn, given how long it has been silent (the observed inter-turn gaps).

A finished request's blocks join one of eight FIFO classes by its continuation probability `p`
(`pagedkv.eviction.sessions`; a preempted request goes to the top class). A block freed `e`
seconds ago will be used again with probability `p S(e) / (1 - p + p S(e))`, `S` the survival
function of the observed gaps between a turn's finish and its session's next arrival: a session
silent for longer than most gaps has probably ended. Within a class that worth only falls with
`e`, so the victim is the least worth among the classes' oldest blocks: eight table lookups per
victim run (a request's blocks, freed together, go together). Before any gap is seen the
classes go by `p` alone. The table is rebuilt as gaps accumulate (amortised O(1)).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.errors import InvariantViolation
from pagedkv.eviction.base import EvictionPolicy
from pagedkv.eviction.sessions import NUM_GAP_BINS, SessionStats, gap_bin
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.request import RequestStatus

# Freed while running (or marked preempted): a preemption, the request comes back.
_COMES_BACK = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels
    from pagedkv.request import Request

NUM_CLASSES = 8
_DEFAULT_CLASS = NUM_CLASSES // 2  # p = 0.5: blocks freed outside a request's free


def class_of(probability: float) -> int:
    klass = int(probability * NUM_CLASSES)
    return klass if klass < NUM_CLASSES else NUM_CLASSES - 1


class HazardPolicy(EvictionPolicy):
    """The oldest block of the class least likely to be used again first.

    Invariants: each class queue holds exactly the policy blocks of that class, oldest freed
    first (`freed_at` non-decreasing from head to tail); the table has one row per class.
    """

    name = "hazard"
    uses_requests = True

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        retention: RetentionLevels | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(blocks, retention)
        self.clock = clock
        self.sessions = SessionStats(clock)
        self._queues = [FreeKVCacheBlockQueue(()) for _ in range(NUM_CLASSES)]
        self._class = bytearray(self.num_blocks)
        self._freed_at = [0.0] * self.num_blocks
        self._free_class = _DEFAULT_CLASS
        self._table_gaps = -1
        self._worth: list[list[float]] = []
        self._rebuild()

    # ------------------------------------------------------------------ request signals

    def _note_arrival(self, request: Request) -> None:
        self.sessions.note_arrival(request)
        # The table changes only here, so a run of victims sees one order however it is
        # batched.
        self._maybe_rebuild()

    def note_freeing(self, request: Request) -> None:
        if request.status in _COMES_BACK:
            self._free_class = NUM_CLASSES - 1
        else:
            self._free_class = class_of(self.sessions.note_finished(request))

    def end_free(self) -> None:
        self._free_class = _DEFAULT_CLASS

    # ------------------------------------------------------------------ the worth table

    def _rebuild(self) -> None:
        """worth[c][bin(e)]: the chance a block of class c freed e seconds ago is used again."""
        sessions = self.sessions
        counts = sessions.gap_counts
        num_gaps = sessions.num_gaps
        self._table_gaps = num_gaps
        probabilities = [(klass + 0.5) / NUM_CLASSES for klass in range(NUM_CLASSES)]
        if not num_gaps:
            self._worth = [[p] * NUM_GAP_BINS for p in probabilities]
            return
        # survival[i]: the share of gaps at least the lower edge of bin i.
        survival = [0.0] * NUM_GAP_BINS
        running = 0
        for index in range(NUM_GAP_BINS - 1, -1, -1):
            running += counts[index]
            survival[index] = running / num_gaps
        # P(next turn | none yet after e) = p S(e) / (1 - p + p S(e)): Bayes on "not yet".
        self._worth = [
            [p * alive / (1.0 - p + p * alive) for alive in survival] for p in probabilities
        ]

    def _maybe_rebuild(self) -> None:
        """Rebuild once the gaps seen grew by an eighth (at least 16): amortised O(1)."""
        if self.sessions.num_gaps - self._table_gaps >= max(16, self._table_gaps >> 3):
            self._rebuild()

    # ------------------------------------------------------------------ the order

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
        self._insert_many((block,))

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        run = blocks if isinstance(blocks, list) else list(blocks)
        if not run:
            return 0
        klass = self._free_class
        now = self.clock()
        class_of_block, freed_at = self._class, self._freed_at
        for block in run:
            block_id = block.block_id
            class_of_block[block_id] = klass
            freed_at[block_id] = now
        self._queues[klass].append_n(run)
        return len(run)

    def _unlink(self, block: KVCacheBlock) -> None:
        self._queues[self._class[block.block_id]].remove(block)

    def _choose(self, now: float) -> FreeKVCacheBlockQueue:
        """The class queue whose oldest block is worth least (the older on a tie)."""
        worth = self._worth
        freed_at = self._freed_at
        best: FreeKVCacheBlockQueue | None = None
        best_worth = 2.0
        best_freed = 0.0
        for klass, queue in enumerate(self._queues):
            if not queue.num_free_blocks:
                continue
            head = queue.fake_free_list_head.next_free_block
            assert head is not None
            freed = freed_at[head.block_id]
            elapsed = now - freed
            value = worth[klass][gap_bin(elapsed if elapsed > 0.0 else 0.0)]
            if value < best_worth or (value == best_worth and freed < best_freed):
                best, best_worth, best_freed = queue, value, freed
        if best is None:
            raise InvariantViolation(f"{self.name}: no block in any class")
        return best

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        # A request's blocks were freed together: take the chosen class's run of equal free
        # times at once (at most what is wanted).
        now = self.clock()
        freed_at = self._freed_at
        num_left = num_victims
        while num_left:
            queue = self._choose(now)
            head = queue.fake_free_list_head.next_free_block
            assert head is not None
            freed = freed_at[head.block_id]
            num_run = 0
            tail = queue.fake_free_list_tail
            block: KVCacheBlock | None = head
            while (
                num_run < num_left
                and block is not None
                and block is not tail
                and freed_at[block.block_id] == freed
            ):
                num_run += 1
                block = block.next_free_block
            out += queue.popleft_n(num_run)
            num_left -= num_run

    def _pop_victim(self) -> KVCacheBlock:
        out: list[KVCacheBlock] = []
        self._pop_victims(1, out)
        return out[0]

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        """Exact victim order now: the classes merged by `_choose`'s rule."""
        now = self.clock()
        worth, freed_at = self._worth, self._freed_at
        cursors = []
        for queue in self._queues:
            block = queue.fake_free_list_head.next_free_block
            cursors.append(block if queue.num_free_blocks else None)
        tails = [queue.fake_free_list_tail for queue in self._queues]
        while True:
            best = -1
            best_worth = 2.0
            best_freed = 0.0
            for klass, block in enumerate(cursors):
                if block is None:
                    continue
                freed = freed_at[block.block_id]
                elapsed = now - freed
                value = worth[klass][gap_bin(elapsed if elapsed > 0.0 else 0.0)]
                if value < best_worth or (value == best_worth and freed < best_freed):
                    best, best_worth, best_freed = klass, value, freed
            if best < 0:
                return
            block = cursors[best]
            assert block is not None
            yield block
            following = block.next_free_block
            cursors[best] = None if following is tails[best] else following

    def _clear(self) -> None:
        self._queues = [FreeKVCacheBlockQueue(()) for _ in range(NUM_CLASSES)]

    def _check(self) -> None:
        self.sessions.check_invariants()
        for klass, queue in enumerate(self._queues):
            queue.check_invariants()
            last = -float("inf")
            for block in queue:
                if self._class[block.block_id] != klass:
                    raise InvariantViolation(f"{self.name}: block {block.block_id} misfiled")
                freed = self._freed_at[block.block_id]
                if freed < last:
                    raise InvariantViolation(f"{self.name}: class {klass} out of free order")
                last = freed
