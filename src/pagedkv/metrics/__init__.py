"""Observability adapters: sampled block residency (stdlib) and its Prometheus export.

`residency`: the pool's `metrics_collector` (lifetimes, idle time before eviction, reuse gaps).
`prometheus` (extra `[metrics]`): `KVCacheMetrics`, `start_http_server`; its names are
re-exported here lazily, so `pagedkv.metrics` imports without prometheus-client.
"""

from __future__ import annotations

from typing import Any

from pagedkv.metrics.residency import KVCacheEvictionEvent, KVCacheMetricsCollector

_PROMETHEUS_NAMES = frozenset(
    {
        "KVCacheMetrics",
        "METRIC_NAMES",
        "MetricsServer",
        "PREFIX",
        "RESIDENCY_BUCKETS_SECONDS",
        "start_http_server",
    }
)


def __getattr__(name: str) -> Any:
    # PEP 562: the Prometheus names import prometheus-client only when first asked for.
    if name in _PROMETHEUS_NAMES:
        from pagedkv.metrics import prometheus

        return getattr(prometheus, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "KVCacheEvictionEvent",
    "KVCacheMetricsCollector",
    *sorted(_PROMETHEUS_NAMES),
]
