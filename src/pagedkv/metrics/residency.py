"""Adapter (stdlib): sampled block-residency metrics, the pool's `metrics_collector`.

Implements the `BlockResidencyObserver` hooks as the reference's `KVCacheMetricsCollector`:
a sampled block's lifetime, idle time before eviction and reuse gaps. Knows nothing of
Prometheus (`pagedkv.metrics` exports what `drain_events` returns).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.block import KVCacheBlock
from pagedkv.errors import InvalidArgumentError

NS_PER_S = 1_000_000_000
ACCESS_HISTORY_LEN = 4
"""Accesses kept per sampled block (the reference's ring): at most 3 reuse gaps per eviction."""


@dataclass(frozen=True, slots=True)
class KVCacheEvictionEvent:
    """Residency of one sampled block, reported when its cache entry is dropped."""

    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]


class _BlockState:
    __slots__ = ("birth_ns", "last_access_ns", "access_history")

    def __init__(self, now_ns: int) -> None:
        self.birth_ns = now_ns
        self.last_access_ns = now_ns
        self.access_history: deque[int] = deque(maxlen=ACCESS_HISTORY_LEN)


class KVCacheMetricsCollector:
    """Samples blocks at allocation and reports their residency when they are evicted.

    - `on_block_allocated`: with probability `sample_rate`, start tracking the block
      (birth = last access = now). A block allocated again without an eviction in between (it
      never entered the prefix cache) starts over, sampled afresh.
    - `on_block_accessed` (a prefix hit): record the access time in a 4-entry ring.
    - `on_block_evicted` (its cache entry is dropped on reuse or by `evict_blocks`): emit
      lifetime = now - birth, idle = now - last access, and the gaps between consecutive ring
      entries.
    - `reset` (prefix-cache reset) forgets every tracked block.

    Also counts every allocation and eviction (sampled or not) for the block counters.
    Pending events are bounded by `max_pending_events`; beyond it the oldest are dropped and
    counted in `num_dropped_events`.

    Args:
        clock: monotonic nanoseconds (tests pass a fake clock).
        rng: the sampling source (seed it for reproducible runs).
    """

    def __init__(
        self,
        sample_rate: float = 0.01,
        clock: Callable[[], int] = time.monotonic_ns,
        rng: random.Random | None = None,
        max_pending_events: int = 100_000,
    ) -> None:
        if (
            isinstance(sample_rate, bool)
            or not isinstance(sample_rate, (int, float))
            or not (0.0 < sample_rate <= 1.0)
        ):
            raise InvalidArgumentError(f"sample_rate must be in (0, 1], got {sample_rate!r}")
        if not isinstance(max_pending_events, int) or max_pending_events < 1:
            raise InvalidArgumentError(
                f"max_pending_events must be a positive int, got {max_pending_events!r}"
            )
        self.sample_rate = float(sample_rate)
        self.clock = clock
        self._random = (rng or random.Random()).random
        self._block_states: dict[int, _BlockState] = {}
        self._events: deque[KVCacheEvictionEvent] = deque(maxlen=max_pending_events)
        self.num_dropped_events = 0
        self.num_blocks_allocated = 0
        """Every block handed out since construction (sampled or not)."""
        self.num_blocks_evicted = 0
        """Every cache entry dropped since construction (sampled or not)."""
        self._num_taken = (0, 0)

    # ------------------------------------------------------------------ pool hooks

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        self.num_blocks_allocated += 1
        if self.sample_rate >= 1.0 or self._random() < self.sample_rate:
            self._block_states[block.block_id] = _BlockState(self.clock())
        else:
            self._block_states.pop(block.block_id, None)

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        state = self._block_states.get(block.block_id)
        if state is None:
            return
        now_ns = self.clock()
        state.last_access_ns = now_ns
        state.access_history.append(now_ns)

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        self.num_blocks_evicted += 1
        state = self._block_states.pop(block.block_id, None)
        if state is None:
            return
        now_ns = self.clock()
        history = list(state.access_history)
        gaps = tuple(
            (later - earlier) / NS_PER_S
            for earlier, later in zip(history, history[1:], strict=False)
        )
        if len(self._events) == self._events.maxlen:
            self.num_dropped_events += 1
        self._events.append(
            KVCacheEvictionEvent(
                lifetime_seconds=(now_ns - state.birth_ns) / NS_PER_S,
                idle_seconds=(now_ns - state.last_access_ns) / NS_PER_S,
                reuse_gaps_seconds=gaps,
            )
        )

    def reset(self) -> None:
        self._block_states.clear()

    # ------------------------------------------------------------------ readers

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        """Return and forget the eviction events gathered since the last call."""
        events = list(self._events)
        self._events.clear()
        return events

    def take_block_counts(self) -> tuple[int, int]:
        """(blocks allocated, blocks evicted) since the last call."""
        totals = (self.num_blocks_allocated, self.num_blocks_evicted)
        taken, self._num_taken = self._num_taken, totals
        return totals[0] - taken[0], totals[1] - taken[1]

    @property
    def num_tracked_blocks(self) -> int:
        return len(self._block_states)
