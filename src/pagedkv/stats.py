"""Leaf: prefix-cache statistics and the sliding-window hit rate."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache counters since the last `make_prefix_cache_stats()`.

    `queries` counts tokens looked up (the request's `num_tokens`), `hits` tokens found.
    Lookups of preempted requests (re-admissions) are counted apart, in the `preempted_*` trio.
    `reset` is True if the prefix cache was reset since the last snapshot.
    """

    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits


class CachingMetrics:
    """Hit rate over the most recent `max_recent_requests` requests (the reference's logger).

    Keeps whole snapshots: the oldest are dropped while more than one remains and the requests
    they cover exceed the limit.
    """

    def __init__(self, max_recent_requests: int = 1000) -> None:
        self.max_recent_requests = max_recent_requests
        self._window: deque[tuple[int, int, int]] = deque()
        self.aggregated_requests = 0
        self.aggregated_queries = 0
        self.aggregated_hits = 0

    def observe(self, stats: PrefixCacheStats) -> None:
        if stats.reset:
            self.reset()
        if stats.requests == 0:
            return
        self._window.append((stats.requests, stats.queries, stats.hits))
        self.aggregated_requests += stats.requests
        self.aggregated_queries += stats.queries
        self.aggregated_hits += stats.hits
        while len(self._window) > 1 and self.aggregated_requests > self.max_recent_requests:
            requests, queries, hits = self._window.popleft()
            self.aggregated_requests -= requests
            self.aggregated_queries -= queries
            self.aggregated_hits -= hits

    def reset(self) -> None:
        self._window.clear()
        self.aggregated_requests = self.aggregated_queries = self.aggregated_hits = 0

    @property
    def empty(self) -> bool:
        return self.aggregated_requests == 0

    @property
    def hit_rate(self) -> float:
        if self.aggregated_queries == 0:
            return 0.0
        return self.aggregated_hits / self.aggregated_queries
