"""Adapter (extra `[metrics]`): Prometheus metrics of KV-cache managers, named like the
reference's `vllm:*` metrics with a `pagedkv:` prefix, in a registry of their own.

Feed it with `observe(...)` (explicit values) or `observe_manager(...)` (pulls from a manager
and its residency collector); serve it with `start_http_server`. Knows no scheduler internals.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedkv.errors import InvalidArgumentError, MissingDependencyError, install_hint
from pagedkv.eviction import EvictionStats
from pagedkv.metrics.residency import KVCacheEvictionEvent
from pagedkv.stats import PrefixCacheStats

try:
    import prometheus_client
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"Prometheus metrics need prometheus-client: {install_hint('metrics')}"
    ) from exc

if TYPE_CHECKING:
    from pagedkv.kv_cache_manager import KVCacheManager
    from pagedkv.metrics.residency import KVCacheMetricsCollector

PREFIX = "pagedkv:"

# Residency spans milliseconds (a block reused within a step) to hours (a hot system prompt).
RESIDENCY_BUCKETS_SECONDS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5,
    1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
)  # fmt: skip

METRIC_NAMES = (
    "pagedkv:kv_cache_usage_perc",
    "pagedkv:prefix_cache_queries",
    "pagedkv:prefix_cache_hits",
    "pagedkv:num_preemptions",
    "pagedkv:kv_blocks_allocated",
    "pagedkv:kv_blocks_evicted",
    "pagedkv:kv_block_lifetime_seconds",
    "pagedkv:kv_block_idle_before_evict_seconds",
    "pagedkv:kv_block_reuse_gap_seconds",
    "pagedkv:kv_retained_blocks",
    "pagedkv:kv_retention_demotions",
    "pagedkv:kv_host_cached_blocks",
    "pagedkv:kv_host_loaded_blocks",
)
"""Names as registered (Prometheus exposes counters with a `_total` suffix)."""


class KVCacheMetrics:
    """The KV-cache metrics of one or more managers, labelled `engine` (as the reference labels
    data-parallel engines). Counters only grow: pass deltas (what happened since the last
    `observe`), as `make_prefix_cache_stats()` and `take_block_counts()` return them.
    """

    def __init__(
        self,
        registry: Any = None,
        residency_buckets_seconds: Iterable[float] = RESIDENCY_BUCKETS_SECONDS,
    ) -> None:
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        labels = ("engine",)
        buckets = tuple(residency_buckets_seconds)
        gauge, counter, histogram = (
            prometheus_client.Gauge,
            prometheus_client.Counter,
            prometheus_client.Histogram,
        )
        reg = self.registry
        self.usage = gauge(
            PREFIX + "kv_cache_usage_perc",
            "KV-cache usage: fraction of usable blocks in use (1 = full).",
            labels,
            registry=reg,
        )
        self.prefix_cache_queries = counter(
            PREFIX + "prefix_cache_queries",
            "Prefix-cache lookups, in tokens queried (preempted requests excluded).",
            labels,
            registry=reg,
        )
        self.prefix_cache_hits = counter(
            PREFIX + "prefix_cache_hits",
            "Prefix-cache hits, in tokens found (preempted requests excluded).",
            labels,
            registry=reg,
        )
        self.num_preemptions = counter(
            PREFIX + "num_preemptions", "Requests preempted.", labels, registry=reg
        )
        self.blocks_allocated = counter(
            PREFIX + "kv_blocks_allocated", "KV-cache blocks handed out.", labels, registry=reg
        )
        self.blocks_evicted = counter(
            PREFIX + "kv_blocks_evicted",
            "Prefix-cache entries dropped (block reused or evicted).",
            labels,
            registry=reg,
        )
        self.block_lifetime = histogram(
            PREFIX + "kv_block_lifetime_seconds",
            "Sampled blocks: allocation to eviction.",
            labels,
            buckets=buckets,
            registry=reg,
        )
        self.block_idle_before_evict = histogram(
            PREFIX + "kv_block_idle_before_evict_seconds",
            "Sampled blocks: last access to eviction.",
            labels,
            buckets=buckets,
            registry=reg,
        )
        self.block_reuse_gap = histogram(
            PREFIX + "kv_block_reuse_gap_seconds",
            "Sampled blocks: time between consecutive prefix hits (last 4 kept per block).",
            labels,
            buckets=buckets,
            registry=reg,
        )
        self.retained_blocks = gauge(
            PREFIX + "kv_retained_blocks",
            "Cached blocks holding a raised retention priority (pagedkv.retention).",
            labels,
            registry=reg,
        )
        self.retention_demotions = counter(
            PREFIX + "kv_retention_demotions",
            "Retention priority raises refused by the cap (the block kept the default).",
            labels,
            registry=reg,
        )
        self.host_cached_blocks = gauge(
            PREFIX + "kv_host_cached_blocks",
            "Blocks held by the host-memory tier.",
            labels,
            registry=reg,
        )
        self.host_loaded_blocks = counter(
            PREFIX + "kv_host_loaded_blocks",
            "Blocks loaded back from the host-memory tier (host hits).",
            labels,
            registry=reg,
        )
        self._last_eviction_stats: dict[str, EvictionStats] = {}

    def observe_eviction(self, stats: EvictionStats, *, engine: str = "0") -> None:
        """Record an engine's eviction state (`manager.get_eviction_stats()`): gauges as they
        are, counters by what grew since the last call for this engine."""
        last = self._last_eviction_stats.get(engine, EvictionStats(stats.policy))
        self.retained_blocks.labels(engine).set(stats.num_retained_blocks)
        self.host_cached_blocks.labels(engine).set(stats.num_host_blocks)
        self.retention_demotions.labels(engine).inc(
            max(0, stats.num_retention_demotions - last.num_retention_demotions)
        )
        self.host_loaded_blocks.labels(engine).inc(
            max(0, stats.num_host_loads - last.num_host_loads)
        )
        self._last_eviction_stats[engine] = stats

    def observe(
        self,
        *,
        engine: str = "0",
        usage: float | None = None,
        prefix_cache_stats: PrefixCacheStats | None = None,
        residency_events: Iterable[KVCacheEvictionEvent] = (),
        num_preemptions: int = 0,
        num_blocks_allocated: int = 0,
        num_blocks_evicted: int = 0,
    ) -> None:
        """Record one step's (or interval's) values for `engine`; counts are deltas."""
        for name, value in (
            ("num_preemptions", num_preemptions),
            ("num_blocks_allocated", num_blocks_allocated),
            ("num_blocks_evicted", num_blocks_evicted),
        ):
            if not isinstance(value, int) or value < 0:
                raise InvalidArgumentError(f"{name} must be an int >= 0 (a delta), got {value!r}")
        if usage is not None:
            if not 0.0 <= usage <= 1.0:
                raise InvalidArgumentError(f"usage must be in [0, 1], got {usage!r}")
            self.usage.labels(engine).set(usage)
        if prefix_cache_stats is not None:
            self.prefix_cache_queries.labels(engine).inc(prefix_cache_stats.queries)
            self.prefix_cache_hits.labels(engine).inc(prefix_cache_stats.hits)
        # Counters are touched even by a zero delta, so every engine's series exists.
        self.num_preemptions.labels(engine).inc(num_preemptions)
        self.blocks_allocated.labels(engine).inc(num_blocks_allocated)
        self.blocks_evicted.labels(engine).inc(num_blocks_evicted)
        lifetime = self.block_lifetime.labels(engine)
        idle = self.block_idle_before_evict.labels(engine)
        gap = self.block_reuse_gap.labels(engine)
        for event in residency_events:
            lifetime.observe(event.lifetime_seconds)
            idle.observe(event.idle_seconds)
            for seconds in event.reuse_gaps_seconds:
                gap.observe(seconds)

    def observe_manager(
        self,
        manager: KVCacheManager,
        collector: KVCacheMetricsCollector | None = None,
        *,
        engine: str = "0",
        num_preemptions: int = 0,
        prefix_cache_stats: PrefixCacheStats | None = None,
    ) -> None:
        """Pull usage from `manager` and drain `collector`. Prefix-cache stats are taken with
        `make_prefix_cache_stats()` unless given (pass them if a scheduler already took them).
        """
        if prefix_cache_stats is None:
            prefix_cache_stats = manager.make_prefix_cache_stats()
        allocated = evicted = 0
        events: list[KVCacheEvictionEvent] = []
        if collector is not None:
            allocated, evicted = collector.take_block_counts()
            events = collector.drain_events()
        self.observe_eviction(manager.get_eviction_stats(), engine=engine)
        self.observe(
            engine=engine,
            usage=manager.usage,
            prefix_cache_stats=prefix_cache_stats,
            residency_events=events,
            num_preemptions=num_preemptions,
            num_blocks_allocated=allocated,
            num_blocks_evicted=evicted,
        )

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format (what /metrics serves)."""
        return prometheus_client.generate_latest(self.registry)


@dataclass
class MetricsServer:
    """A running /metrics HTTP server (a daemon thread); `port` is the bound port."""

    server: Any
    thread: Any

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start_http_server(metrics: KVCacheMetrics, port: int, addr: str = "127.0.0.1") -> MetricsServer:
    """Serve `metrics` on http://addr:port/metrics (port 0: any free port; see `.port`).

    Binds loopback by default; pass addr="0.0.0.0" to let a remote Prometheus scrape it.
    """
    if not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(f"port must be in [0, 65535], got {port!r}")
    server, thread = prometheus_client.start_http_server(port, addr, registry=metrics.registry)
    return MetricsServer(server, thread)
