"""`pagedkv simulate --instances N --router ...`: instances publish KV events over ZeroMQ, the
router's index is fed only by them; policies compared on a small trace; metrics served."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv.cli import main  # noqa: E402
from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.sched import SchedulerConfig  # noqa: E402
from pagedkv.sim.cluster import ClusterConfig, simulate_cluster  # noqa: E402
from pagedkv.sim.cost_model import DEFAULT_PROFILE, get_profile  # noqa: E402
from pagedkv.sim.inputs.workloads import WorkloadParams, make_workload  # noqa: E402
from pagedkv.sim.serve import ServeConfig  # noqa: E402
from tests.support.redis_server import free_port  # noqa: E402

POLICIES = ("round-robin", "least-loaded", "prefix-aware")


def small_chat_trace():
    params = WorkloadParams(
        num_requests=48,
        rate_per_s=4.0,
        seed=3,
        system_prompt_tokens=256,
        num_system_prompts=2,
        user_tokens=(16, 64),
        output_tokens=(8, 24),
        turns=(3, 5),
        think_time_s=1.0,
    )
    return make_workload("chat", params)


def serve_config(num_blocks: int = 400, max_model_len: int = 4096) -> ServeConfig:
    return ServeConfig(
        num_blocks=num_blocks,
        cost_model=get_profile(DEFAULT_PROFILE).cost_model(),
        scheduler=SchedulerConfig(max_model_len=max_model_len),
        max_model_len=max_model_len,
    )


def test_policies_on_a_small_chat_trace():
    trace = small_chat_trace()
    results = simulate_cluster(trace, ClusterConfig(serve_config(), 3), POLICIES)
    by_router = {r["router"]: r for r in results}
    assert list(by_router) == list(POLICIES)
    for result in results:
        assert result["num_requests_completed"] == 48
        assert result["routing"]["index_matches_pools"] is True
        assert result["routing"]["fallback_decisions"] == 0
        for instance in result["instances"]:
            assert instance["subscriber"]["missed"] == 0
            assert instance["subscriber"]["malformed"] == 0
            assert instance["events_dropped"] == 0
    assert by_router["round-robin"]["load_balance"]["requests_per_instance"] == [16, 16, 16]
    # Conversations continue where their history is cached: prefix-aware routing hits more.
    prefix_rate = by_router["prefix-aware"]["prefix_cache"]["hit_rate"]
    assert prefix_rate > by_router["round-robin"]["prefix_cache"]["hit_rate"]
    assert prefix_rate > by_router["least-loaded"]["prefix_cache"]["hit_rate"]
    assert by_router["prefix-aware"]["routing"]["mean_matched_blocks"] > 0
    assert by_router["round-robin"]["routing"]["mean_matched_blocks"] == 0


def test_cluster_runs_are_deterministic_over_tcp_too():
    trace = small_chat_trace()
    inproc = simulate_cluster(trace, ClusterConfig(serve_config(), 2), ["prefix-aware"])
    tcp = simulate_cluster(
        trace, ClusterConfig(serve_config(), 2, event_transport="tcp"), ["prefix-aware"]
    )

    def strip(results):  # event transport details aside, the simulation is identical
        for result in results:
            for instance in result["instances"]:
                instance.pop("subscriber")
        return results

    assert strip(inproc) == strip(tcp)


def test_metrics_observed_per_instance_step():
    from pagedkv.metrics import KVCacheMetrics

    metrics = KVCacheMetrics()
    trace = small_chat_trace()
    config = ClusterConfig(serve_config(120, 1024), 2, residency_sample_rate=1.0)
    (result,) = simulate_cluster(trace, config, ["least-loaded"], metrics)
    registry = metrics.registry
    queries = sum(
        registry.get_sample_value("pagedkv:prefix_cache_queries_total", {"engine": e})
        for e in ("0", "1")
    )
    hits = sum(
        registry.get_sample_value("pagedkv:prefix_cache_hits_total", {"engine": e})
        for e in ("0", "1")
    )
    assert (queries, hits) == (result["prefix_cache"]["queries"], result["prefix_cache"]["hits"])
    preemptions = sum(i["preemptions"] for i in result["instances"])
    assert preemptions == sum(
        registry.get_sample_value("pagedkv:num_preemptions_total", {"engine": e})
        for e in ("0", "1")
    )
    allocated = registry.get_sample_value("pagedkv:kv_blocks_allocated_total", {"engine": "0"})
    assert allocated > 0
    evicted = sum(
        registry.get_sample_value("pagedkv:kv_blocks_evicted_total", {"engine": e})
        for e in ("0", "1")
    )
    lifetimes = sum(
        registry.get_sample_value("pagedkv:kv_block_lifetime_seconds_count", {"engine": e})
        for e in ("0", "1")
    )
    assert evicted > 0 and lifetimes == evicted  # every block sampled (rate 1.0)


def run_cli(capsys, *extra: str) -> tuple[int, str, str]:
    code = main(
        ["simulate", "--workload", "chat", "--num-requests", "24", "--rate", "4",
         "--capacity", "2000", *extra]
    )  # fmt: skip
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_all_routers_json_report(capsys):
    code, out, _ = run_cli(capsys, "--instances", "2", "--router", "all", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["mode"] == "cluster" and report["config"]["instances"] == 2
    assert [r["router"] for r in report["results"]] == list(POLICIES)
    assert all(r["num_requests_completed"] == 24 for r in report["results"])


def test_cli_table_and_bad_arguments(capsys):
    code, out, _ = run_cli(capsys, "--instances", "2", "--router", "prefix-aware")
    assert code == 0
    assert "prefix-aware" in out and "router index equals every instance's cache" in out
    code, _, err = run_cli(capsys, "--instances", "0")
    assert code == 2 and "argument --instances: must be >= 1, got 0" in err
    code, _, err = run_cli(capsys, "--instances", "2", "--mode", "replay")
    assert code == 2 and "need --mode serve" in err
    with pytest.raises(ConfigError, match="num_instances"):
        ClusterConfig(serve_config(), 0)
    with pytest.raises(ConfigError, match="unknown router"):
        simulate_cluster(small_chat_trace(), ClusterConfig(serve_config(), 1), ["random"])


def test_cli_serves_metrics_while_running(capsys):
    pytest.importorskip("prometheus_client")
    port = free_port()
    bodies: list[str] = []

    def scrape() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not bodies:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
                    body = r.read().decode()
                if "pagedkv:kv_cache_usage_perc{" in body:
                    bodies.append(body)
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.05)

    scraper = threading.Thread(target=scrape)
    scraper.start()
    code, out, err = run_cli(
        capsys, "--metrics-port", str(port), "--metrics-linger-s", "2", "--json"
    )
    scraper.join()
    assert code == 0 and f"metrics on http://127.0.0.1:{port}/metrics" in err
    assert json.loads(out)["config"]["instances"] == 1  # --metrics-port alone: one instance
    assert bodies and 'pagedkv:prefix_cache_queries_total{engine="0"}' in bodies[0]
