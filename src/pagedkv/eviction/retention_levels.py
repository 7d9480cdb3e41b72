"""Eviction layer: retention priorities on top of any policy (TensorRT-LLM's prioritized reuse).

A cached block has a priority (0..100, default 35) and optionally a duration, from the hints of
the request that cached or last hit it (`pagedkv.retention`). While free, a block of a
non-default priority is *parked* here, one queue per priority (least recently freed first),
instead of in the policy's order: lower priorities are evicted before the policy's blocks,
higher ones only after. A duration lapses that long after the block's last use; the block then
returns to the default priority and the policy's order. Retained blocks stay evictable (last),
so they can never make an allocation fail; `max_retained_blocks` caps how many blocks may hold
a raised priority at once, and a hint beyond the cap is demoted to the default (counted in
`num_demoted_blocks`).
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.retention import DEFAULT_PRIORITY

if TYPE_CHECKING:
    from pagedkv.request import Request

_NEVER = math.inf


class RetentionLevels:
    """Per-block priorities and the parked free blocks of non-default priority.

    Invariants (`check_invariants`): a block has a non-default priority only while cached; a
    free cached block is parked iff its priority is not the default; each priority's queue
    holds exactly its parked blocks; `num_retained_blocks` counts cached blocks (held or free)
    above the default and never exceeds `max_retained_blocks`.
    """

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        max_retained_blocks: int,
        clock: Callable[[], float],
    ) -> None:
        if type(max_retained_blocks) is not int or max_retained_blocks < 0:
            raise ConfigError(f"max_retained_blocks={max_retained_blocks!r} must be an int >= 0")
        self.blocks = blocks
        self.max_retained_blocks = max_retained_blocks
        self.clock = clock
        num_blocks = len(blocks)
        self._priority = bytearray([DEFAULT_PRIORITY]) * num_blocks
        self._duration_s: list[float | None] = [None] * num_blocks
        self._expires_at = [_NEVER] * num_blocks
        self._parked = bytearray(num_blocks)
        self._levels: dict[int, FreeKVCacheBlockQueue] = {}
        self._low: list[int] = []  # priorities below the default with a queue, ascending
        self._high: list[int] = []  # priorities above the default with a queue, ascending
        self._expiry_heap: list[tuple[float, int, int]] = []
        self._entry_stamp = [0] * num_blocks
        self._next_stamp = 1
        self.num_parked_blocks = 0
        self.num_retained_blocks = 0
        self.num_demoted_blocks = 0
        self.num_lapsed_blocks = 0

    # ------------------------------------------------------------------ priorities

    def priority_of(self, block: KVCacheBlock) -> int:
        return self._priority[block.block_id]

    def apply_hints(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
        is_new: bool,
    ) -> None:
        """Give blocks `[start, end)` of a request's table the priority its hints name.

        `is_new`: the blocks were just cached (else hit: a hint also re-prioritises a hit
        block; a block the hint leaves at the default keeps the priority it had).
        """
        config = request.retention
        if config is None:
            return
        now = self.clock()
        num_prompt_tokens = request.num_prompt_tokens
        for index in range(start, end):
            block = blocks[index]
            if block.block_hash is None or (skipped_ids is not None and id(block) in skipped_ids):
                continue
            priority, duration_s = config.block_priority(
                index * block_size, (index + 1) * block_size, num_prompt_tokens
            )
            if priority != DEFAULT_PRIORITY or duration_s is not None or is_new:
                self.assign(block, priority, duration_s, now)

    def assign(
        self, block: KVCacheBlock, priority: int, duration_s: float | None, now: float
    ) -> None:
        """Set a held block's priority (a raise beyond the cap is demoted to the default)."""
        block_id = block.block_id
        old = self._priority[block_id]
        if priority > DEFAULT_PRIORITY >= old:
            if self.num_retained_blocks >= self.max_retained_blocks:
                self.num_demoted_blocks += 1
                priority, duration_s = DEFAULT_PRIORITY, None
            else:
                self.num_retained_blocks += 1
        elif old > DEFAULT_PRIORITY >= priority:
            self.num_retained_blocks -= 1
        self._priority[block_id] = priority
        self._duration_s[block_id] = duration_s
        self._expires_at[block_id] = _NEVER if duration_s is None else now + duration_s

    def refresh(self, block: KVCacheBlock) -> None:
        """The block was used: its duration starts again."""
        duration_s = self._duration_s[block.block_id]
        if duration_s is not None:
            self._expires_at[block.block_id] = self.clock() + duration_s

    def forget(self, block: KVCacheBlock) -> None:
        """The block left the cache: back to the default priority."""
        block_id = block.block_id
        if self._parked[block_id]:
            self.unpark(block)
        if self._priority[block_id] > DEFAULT_PRIORITY:
            self.num_retained_blocks -= 1
        self._priority[block_id] = DEFAULT_PRIORITY
        self._duration_s[block_id] = None
        self._expires_at[block_id] = _NEVER

    def _lapse(self, block: KVCacheBlock) -> None:
        self.forget(block)
        self.num_lapsed_blocks += 1

    # ------------------------------------------------------------------ parked free blocks

    def is_parked(self, block: KVCacheBlock) -> bool:
        return bool(self._parked[block.block_id])

    def park(self, block: KVCacheBlock) -> bool:
        """A cached block became free: park it if its priority is not the default (and has not
        lapsed); return whether it was parked."""
        block_id = block.block_id
        priority = self._priority[block_id]
        if priority == DEFAULT_PRIORITY:
            return False
        expires_at = self._expires_at[block_id]
        if expires_at <= self.clock():
            self._lapse(block)
            return False
        queue = self._levels.get(priority)
        if queue is None:
            queue = self._levels[priority] = FreeKVCacheBlockQueue(())
            bisect.insort(self._low if priority < DEFAULT_PRIORITY else self._high, priority)
        queue.append(block)
        self._parked[block_id] = 1
        self.num_parked_blocks += 1
        if expires_at != _NEVER:
            stamp = self._next_stamp
            self._next_stamp = stamp + 1
            self._entry_stamp[block_id] = stamp
            heapq.heappush(self._expiry_heap, (expires_at, stamp, block_id))
        return True

    def unpark(self, block: KVCacheBlock) -> None:
        """Take a parked block out of its queue (hit, evicted or lapsed)."""
        block_id = block.block_id
        priority = self._priority[block_id]
        queue = self._levels[priority]
        queue.remove(block)
        self._parked[block_id] = 0
        self._entry_stamp[block_id] = 0
        self.num_parked_blocks -= 1
        if not queue.num_free_blocks:
            del self._levels[priority]
            (self._low if priority < DEFAULT_PRIORITY else self._high).remove(priority)

    def pop_parked(self, low: bool) -> KVCacheBlock | None:
        """Evict the least recently freed block of the lowest priority below (`low`) or above
        the default; None if there is none."""
        priorities = self._low if low else self._high
        if not priorities:
            return None
        block = self._levels[priorities[0]].fake_free_list_head.next_free_block
        assert block is not None
        self.forget(block)
        return block

    def expire(self, adopt: Callable[[KVCacheBlock], None]) -> None:
        """Return every parked block whose duration lapsed to the default priority (`adopt`
        puts it in the policy's order)."""
        heap = self._expiry_heap
        if not heap:
            return
        now = self.clock()
        stamps = self._entry_stamp
        while heap and heap[0][0] <= now:
            _, stamp, block_id = heapq.heappop(heap)
            if stamps[block_id] != stamp:
                continue  # the block was hit or evicted since it was parked
            block = self.blocks[block_id]
            self._lapse(block)
            adopt(block)

    def iter_parked(self, low: bool) -> Iterator[KVCacheBlock]:
        for priority in self._low if low else self._high:
            yield from self._levels[priority]

    def clear(self) -> None:
        """Every block left the cache."""
        num_blocks = len(self.blocks)
        self._priority = bytearray([DEFAULT_PRIORITY]) * num_blocks
        self._duration_s = [None] * num_blocks
        self._expires_at = [_NEVER] * num_blocks
        self._parked = bytearray(num_blocks)
        self._levels.clear()
        self._low.clear()
        self._high.clear()
        self._expiry_heap.clear()
        self._entry_stamp = [0] * num_blocks
        self.num_parked_blocks = self.num_retained_blocks = 0

    def check_invariants(self) -> None:
        num_retained = num_parked = 0
        for block in self.blocks:
            block_id = block.block_id
            priority = self._priority[block_id]
            if priority != DEFAULT_PRIORITY and block.block_hash is None:
                raise InvariantViolation(f"uncached block {block_id} has priority {priority}")
            num_retained += priority > DEFAULT_PRIORITY
            parked = self._parked[block_id]
            num_parked += parked
            if parked and (block.ref_cnt or priority == DEFAULT_PRIORITY):
                raise InvariantViolation(f"block {block_id} is parked but held or at default")
        for priority, queue in self._levels.items():
            queue.check_invariants()
            if not queue.num_free_blocks:
                raise InvariantViolation(f"empty retention queue for priority {priority}")
            for block in queue:
                if self._priority[block.block_id] != priority or not self._parked[block.block_id]:
                    raise InvariantViolation(f"block {block.block_id} in the wrong queue")
        if sorted(self._levels) != self._low + self._high:
            raise InvariantViolation("retention: the priority lists do not match the queues")
        if num_parked != self.num_parked_blocks or num_retained != self.num_retained_blocks:
            raise InvariantViolation(
                f"retention: counted {num_parked} parked and {num_retained} retained, recorded "
                f"{self.num_parked_blocks} and {self.num_retained_blocks}"
            )
        if self.num_retained_blocks > self.max_retained_blocks:
            raise InvariantViolation("retention: more retained blocks than the cap")
