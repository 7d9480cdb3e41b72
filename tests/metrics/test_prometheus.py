"""Prometheus metrics: names, values from a real manager and residency collector, the HTTP
endpoint, and bad input."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from pagedkv import InvalidArgumentError, Request, make_request_block_hasher  # noqa: E402
from pagedkv.metrics import METRIC_NAMES, KVCacheMetrics, start_http_server  # noqa: E402
from pagedkv.metrics.residency import KVCacheEvictionEvent, KVCacheMetricsCollector  # noqa: E402
from pagedkv.stats import PrefixCacheStats  # noqa: E402
from tests.support.kv_workload import make_manager  # noqa: E402


def sample(metrics: KVCacheMetrics, name: str, engine: str = "0", **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {"engine": engine, **labels})


def test_observe_explicit_values():
    metrics = KVCacheMetrics()
    stats = PrefixCacheStats(requests=2, queries=100, hits=40, preempted_queries=9)
    metrics.observe(
        usage=0.25,
        prefix_cache_stats=stats,
        residency_events=[
            KVCacheEvictionEvent(3.0, 1.0, (1.0, 0.5)),
            KVCacheEvictionEvent(5, 5, ()),
        ],
        num_preemptions=1,
        num_blocks_allocated=7,
        num_blocks_evicted=2,
    )
    metrics.observe(engine="1", usage=0.5, prefix_cache_stats=stats)
    assert sample(metrics, "pagedkv:kv_cache_usage_perc") == 0.25
    assert sample(metrics, "pagedkv:kv_cache_usage_perc", "1") == 0.5
    assert sample(metrics, "pagedkv:prefix_cache_queries_total") == 100
    assert sample(metrics, "pagedkv:prefix_cache_hits_total") == 40
    assert sample(metrics, "pagedkv:num_preemptions_total") == 1
    assert sample(metrics, "pagedkv:kv_blocks_allocated_total") == 7
    assert sample(metrics, "pagedkv:kv_blocks_evicted_total") == 2
    assert sample(metrics, "pagedkv:kv_block_lifetime_seconds_count") == 2
    assert sample(metrics, "pagedkv:kv_block_lifetime_seconds_sum") == 8.0
    assert sample(metrics, "pagedkv:kv_block_idle_before_evict_seconds_sum") == 6.0
    assert sample(metrics, "pagedkv:kv_block_reuse_gap_seconds_count") == 2
    assert sample(metrics, "pagedkv:kv_block_reuse_gap_seconds_bucket", le="0.5") == 1
    text = metrics.exposition().decode()
    for name in METRIC_NAMES:
        assert f"# HELP {name}" in text or f"# HELP {name}_total" in text


def test_observe_manager_pulls_stats_usage_and_residency():
    collector = KVCacheMetricsCollector(sample_rate=1.0)
    manager = make_manager(num_blocks=9, events=False, log_stats=True, metrics_collector=collector)
    hasher = make_request_block_hasher(4)
    first = Request("a", list(range(17)), block_hasher=hasher)
    hit = manager.get_computed_blocks(first)
    manager.allocate_slots(first, 17, hit.num_computed_tokens, hit.blocks)
    manager.record_prefix_cache_stats(first, hit.num_computed_tokens)
    manager.free(first)
    second = Request("b", list(range(16)) + [5], block_hasher=hasher)
    hit = manager.get_computed_blocks(second)
    assert hit.num_computed_tokens == 16
    manager.allocate_slots(second, 1, hit.num_computed_tokens, hit.blocks)
    manager.record_prefix_cache_stats(second, hit.num_computed_tokens)
    manager.free(second)
    # Free queue: 5 (partial, unhashed), 6, 7, 8, then cached 4, 3, 2, 1 (tail first).
    third = Request("c", [9] * 24, block_hasher=hasher)  # 6 blocks: evicts blocks 4 and 3
    assert manager.allocate_slots(third, 24).get_block_ids() == ([5, 6, 7, 8, 4, 3],)
    metrics = KVCacheMetrics()
    metrics.observe_manager(manager, collector, engine="7", num_preemptions=2)
    assert sample(metrics, "pagedkv:kv_cache_usage_perc", "7") == manager.usage == 1.0 - 2 / 8
    assert sample(metrics, "pagedkv:prefix_cache_queries_total", "7") == 34
    assert sample(metrics, "pagedkv:prefix_cache_hits_total", "7") == 16
    assert sample(metrics, "pagedkv:num_preemptions_total", "7") == 2
    assert sample(metrics, "pagedkv:kv_blocks_allocated_total", "7") == 5 + 1 + 6
    assert sample(metrics, "pagedkv:kv_blocks_evicted_total", "7") == 2
    assert sample(metrics, "pagedkv:kv_block_lifetime_seconds_count", "7") == 2
    assert sample(metrics, "pagedkv:kv_block_reuse_gap_seconds_count", "7") == 0  # one hit each


def test_http_server_serves_metrics():
    metrics = KVCacheMetrics()
    metrics.observe(usage=0.75)
    server = start_http_server(metrics, 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5) as reply:
            body = reply.read().decode()
    finally:
        server.shutdown()
    assert 'pagedkv:kv_cache_usage_perc{engine="0"} 0.75' in body


def test_bad_input_is_rejected_and_changes_nothing():
    metrics = KVCacheMetrics()
    with pytest.raises(InvalidArgumentError, match="usage"):
        metrics.observe(usage=1.5)
    with pytest.raises(InvalidArgumentError, match="num_preemptions"):
        metrics.observe(num_preemptions=-1, usage=0.5)
    assert sample(metrics, "pagedkv:kv_cache_usage_perc") is None
    with pytest.raises(InvalidArgumentError, match="port"):
        start_http_server(metrics, 70000)
