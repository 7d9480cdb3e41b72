"""Cache-aware routing through real Redis faults (issue 11): a cluster run whose index lives in
a redis-server that the test kills, stalls, restarts or flushes mid-run, by pid.

Each run audits every decision made on the index against the truth (an index fed by the
publishers themselves): no phantom hit at any point, no inexact decision, and the whole index
compared with the truth every 25 decisions; after recovery the index equals every pool.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.support.redis_server import RedisServer, import_redis

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv.cli import main  # noqa: E402
from pagedkv.sched import SchedulerConfig  # noqa: E402
from pagedkv.sim.cluster import ClusterConfig, simulate_cluster  # noqa: E402
from pagedkv.sim.cost_model import DEFAULT_PROFILE, get_profile  # noqa: E402
from pagedkv.sim.inputs.workloads import WorkloadParams, make_workload  # noqa: E402
from pagedkv.sim.serve import ServeConfig  # noqa: E402

pytestmark = pytest.mark.redis

NUM_REQUESTS = 60
RETRY_INTERVAL_S = 0.1


def chat_trace():
    params = WorkloadParams(
        num_requests=NUM_REQUESTS,
        rate_per_s=4.0,
        seed=7,
        system_prompt_tokens=256,
        num_system_prompts=2,
        user_tokens=(16, 64),
        output_tokens=(8, 24),
        turns=(3, 5),
        think_time_s=1.0,
    )
    return make_workload("chat", params)


def cluster_config(url: str) -> ClusterConfig:
    # 300 blocks per instance: the chat histories outgrow it, so blocks are evicted (and
    # removals are published) while the faults happen.
    serve = ServeConfig(
        num_blocks=300,
        cost_model=get_profile(DEFAULT_PROFILE).cost_model(),
        scheduler=SchedulerConfig(max_model_len=4096),
        max_model_len=4096,
    )
    return ClusterConfig(
        serve, 3, index_url=url, index_retry_interval_s=RETRY_INTERVAL_S, audit_index=True
    )


class Fault:
    """Progress callback: `inject` when `start` requests are done, `heal` when `end` are
    done, after waiting (the simulation waits too) until the fault lasted `min_outage_s`."""

    def __init__(self, inject, heal=None, start=15, end=35, min_outage_s=0.0) -> None:
        self.inject, self.heal = inject, heal
        self.start, self.end, self.min_outage_s = start, end, min_outage_s
        self.injected_at: float | None = None
        self.healed = False

    def __call__(self, num_done: int) -> None:
        if self.injected_at is None and num_done >= self.start:
            self.inject()
            self.injected_at = time.monotonic()
        elif (
            self.injected_at is not None
            and not self.healed
            and self.heal is not None
            and num_done >= self.end
        ):
            time.sleep(max(0.0, self.injected_at + self.min_outage_s - time.monotonic()))
            self.heal()
            self.healed = True
            time.sleep(2 * RETRY_INTERVAL_S)  # the next index call is a recovery attempt


def run_with(server: RedisServer, fault: Fault) -> dict:
    [result] = simulate_cluster(
        chat_trace(), cluster_config(server.url), ["prefix-aware"], progress=fault
    )
    return result


def assert_exact_after_recovery(result: dict) -> None:
    routing = result["routing"]
    assert result["num_requests_completed"] + result["num_requests_rejected"] == NUM_REQUESTS
    assert routing["index_outages"] == 1 and routing["index_recoveries"] == 1, routing
    assert routing["fallback_decisions"] > 0
    assert routing["index_available"] and routing["index_exact"]
    assert routing["index_matches_pools"] is True
    audit = routing["audit"]
    assert audit["phantom_hit_decisions"] == 0 and audit["inexact_decisions"] == 0, audit
    assert audit["contents_mismatches"] == 0 and audit["contents_checks"] >= 1, audit
    # Decisions were made on the index before and after the outage.
    assert audit["decisions_on_index"] + routing["fallback_decisions"] > NUM_REQUESTS // 2


@pytest.fixture
def server(tmp_path):
    import_redis()
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.stop()


def test_sigkill_and_restart_recovers_exactly(server):
    fault = Fault(server.kill, server.start)
    result = run_with(server, fault)
    assert fault.healed
    assert_exact_after_recovery(result)
    assert result["routing"]["dropped_event_batches"] > 0


def test_sigstop_and_sigcont_recover_exactly_with_no_late_write(server):
    # Writes sent during the stall reach Redis after SIGCONT: the epoch fences them.
    fault = Fault(server.pause, server.resume, min_outage_s=1.0)
    result = run_with(server, fault)
    assert fault.healed
    assert_exact_after_recovery(result)


def test_restart_with_an_empty_database_is_noticed_and_resynchronised(server):
    # A flush keeps the connection: no error, but the next write or score finds the epoch
    # gone (IndexLostError) instead of answering from an empty index.
    redis = import_redis()
    client = redis.Redis.from_url(server.url)
    fault = Fault(client.flushall, heal=lambda: None, start=20, end=30)
    result = run_with(server, fault)
    client.close()
    assert fault.injected_at is not None
    assert_exact_after_recovery(result)


def test_killed_for_good_falls_back_and_still_reports(server):
    fault = Fault(server.kill, start=15)
    result = run_with(server, fault)
    routing = result["routing"]
    assert result["num_requests_completed"] + result["num_requests_rejected"] == NUM_REQUESTS
    assert routing["index_available"] is False and routing["index_exact"] is False
    assert routing["index_matches_pools"] is None
    assert routing["index_outages"] == 1 and routing["index_recoveries"] == 0
    assert routing["fallback_decisions"] > 0
    assert routing["audit"]["phantom_hit_decisions"] == 0
    assert routing["audit"]["inexact_decisions"] == 0


def test_cli_index_redis_reports_matching_pools(server, capsys):
    argv = ["simulate", "--workload", "chat", "--num-requests", "30", "--rate", "4",
            "--capacity", "400", "--instances", "2", "--router", "prefix-aware",
            "--index", server.url, "--json"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["index"] == server.url
    [result] = report["results"]
    assert result["routing"]["index"] == "redis"
    assert result["routing"]["index_matches_pools"] is True
    assert result["routing"]["fallback_decisions"] == 0


def test_cli_index_refuses_an_unreachable_server_before_running(server, capsys):
    url = server.url
    server.kill()
    argv = ["simulate", "--workload", "chat", "--num-requests", "10", "--instances", "2",
            "--index", url]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv simulate: error: --index {url}: ") and "Traceback" not in err
    assert main([*argv[:-1], "mongodb://x"]) == 2
    assert "index_url must be redis://" in capsys.readouterr().err
