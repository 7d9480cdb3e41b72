"""The simulator's eviction study: the future oracle, the multi-policy replay (lru equals
`replay`, belady bounds every online policy), the host tier in replay and serve, and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.cli import main
from pagedkv.errors import RequestStateError
from pagedkv.eviction import EVICTION_POLICY_NAMES, NEVER, ONLINE_POLICY_NAMES
from pagedkv.sim.cost_model import get_profile
from pagedkv.sim.eviction_replay import parse_policies, replay_policies
from pagedkv.sim.inputs.future import ReplayOracle
from pagedkv.sim.inputs.traces import Trace, TraceRequest, load_trace
from pagedkv.sim.replay import replay
from pagedkv.sim.report.eviction import gap_closed
from pagedkv.sim.serve import ServeConfig, ServeRun
from tests.support.paths import DATA_DIR

DATA = DATA_DIR
TRACE = str(DATA / "mooncake_conversations46.jsonl")


def explicit_trace(prompts: list[list[int]]) -> Trace:
    requests = tuple(
        TraceRequest(f"r{i}", float(i), len(p), 4, (), 10_000 + 10 * i, 0, tuple(p))
        for i, p in enumerate(prompts)
    )
    return Trace("t", requests, "memory")


# ---------------------------------------------------------------------------- the oracle


def test_oracle_answers_the_next_use_after_the_current_request():
    oracle = ReplayOracle([["a", "b"], ["b"], [], ["a", "c"], ["b"]])
    assert [oracle.next_use(k) for k in "abcd"] == [0, 0, 3, NEVER]
    oracle.advance(0)
    assert [oracle.next_use(k) for k in "abc"] == [3, 1, 3]
    oracle.advance(1)
    assert oracle.next_use("b") == 4
    oracle.advance(2)
    oracle.advance(3)
    assert [oracle.next_use(k) for k in "abc"] == [NEVER, 4, NEVER]


# ---------------------------------------------------------------------------- replay


def test_lru_gives_exactly_the_replay_hit_rates():
    trace = load_trace(DATA / "mooncake_head40.jsonl")
    capacities = [500, 2000, 8000]
    expected = [point.num_hit_tokens for point in replay(trace, capacities, 16)]
    points = replay_policies(trace, capacities, ["lru"], 16)
    assert [point.num_device_hit_tokens for point in points] == expected
    assert sum(expected) > 0


prompt = st.lists(st.integers(0, 30), min_size=1, max_size=10)


@settings(max_examples=25, deadline=None, database=None, derandomize=True)
@given(
    prefixes=st.lists(
        st.lists(st.integers(0, 30), min_size=4, max_size=20), min_size=1, max_size=4
    ),
    picks=st.lists(st.tuples(st.integers(0, 3), prompt), min_size=2, max_size=40),
    capacity=st.integers(6, 30),
)
def test_belady_bounds_every_online_policy(prefixes, picks, capacity):
    prompts = [prefixes[i % len(prefixes)] + suffix for i, suffix in picks]
    points = replay_policies(explicit_trace(prompts), [capacity], EVICTION_POLICY_NAMES, 4)
    hits = {point.policy: point.num_device_hit_tokens for point in points}
    assert all(hits[name] <= hits["belady"] for name in ONLINE_POLICY_NAMES), hits
    not_fit = {point.num_requests_not_fit for point in points}
    assert len(not_fit) == 1  # which prompts fit depends on the capacity only


def test_a_host_tier_adds_host_hits_and_never_loses_device_hits():
    trace = load_trace(TRACE)
    without = replay_policies(trace, [1200], ["lru", "s3fifo"], 16)
    with_host = replay_policies(trace, [1200], ["lru", "s3fifo"], 16, host_capacity_blocks=20_000)
    for plain, hosted in zip(without, with_host, strict=True):
        assert hosted.num_host_hit_tokens > 0
        assert hosted.host_capacity_blocks == 20_000
        assert (
            hosted.num_device_hit_tokens + hosted.num_host_hit_tokens >= plain.num_device_hit_tokens
        )


def test_policy_lists_and_gap_closed():
    assert parse_policies("all") == list(EVICTION_POLICY_NAMES)
    assert parse_policies(" LRU, belady,lru") == ["lru", "belady"]
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        parse_policies("lru,mru")
    assert gap_closed(0.10, 0.14, 0.22) == pytest.approx(1 / 3)
    assert gap_closed(0.10, 0.10, 0.10) is None


# ---------------------------------------------------------------------------- serve


def serve_config(**kwargs) -> ServeConfig:
    profile = get_profile("llama3.1-8b-h100")
    return ServeConfig(
        num_blocks=1500,
        cost_model=profile.cost_model(),
        block_size=16,
        max_model_len=24_000,
        **kwargs,
    )


def test_serve_waits_for_host_loads_and_charges_the_pcie_time():
    trace = load_trace(TRACE, limit=30)
    profile = get_profile("llama3.1-8b-h100")
    assert profile.host_load_s_per_token == pytest.approx(131072 / (64e9 * 0.8))
    results = {}
    for seconds in (profile.host_load_s_per_token, 1e-3):
        run = ServeRun(
            trace,
            serve_config(host_num_blocks=20_000, host_load_s_per_token=seconds, eviction="arc"),
        )
        run.run(None)
        run.scheduler.check_invariants()
        summary = run.summary()
        assert summary["num_requests_completed"] + summary["num_requests_rejected"] == 30
        assert not run.scheduler.loading and not run.kv_loads
        results[seconds] = summary
    fast, slow = results.values()
    assert fast["host_tier"]["num_loads"] == slow["host_tier"]["num_loads"] > 0
    assert fast["host_tier"]["loaded_tokens"] > 0
    assert slow["ttft_s"]["mean"] > fast["ttft_s"]["mean"]


def test_serve_with_the_lookahead_and_session_policies():
    """Under a queue the look-ahead holds back blocks waiting requests will hit; every session
    policy serves the trace to the end, deterministically."""
    trace = load_trace(TRACE)
    summaries = {}
    for eviction, lookahead in (("lru", False), ("lru", True), ("continuation", True),
                                ("hazard", False), ("hazard", False)):  # fmt: skip
        run = ServeRun(
            trace,
            serve_config(eviction=eviction, lookahead=lookahead, time_scale=0.05),
        )
        run.run(None)
        run.scheduler.check_invariants()
        summary = run.summary()
        assert summary["num_requests_completed"] + summary["num_requests_rejected"] == 46
        stats = run.manager.get_eviction_stats()
        assert stats.policy == eviction
        assert (stats.num_lookahead_protections > 0) == lookahead
        assert stats.num_protected_blocks == 0 or lookahead
        summaries.setdefault((eviction, lookahead), []).append(summary)
    assert summaries[("hazard", False)][0] == summaries[("hazard", False)][1]


def test_belady_is_refused_in_serve_mode():
    with pytest.raises(ValueError, match="belady needs the future"):
        serve_config(eviction="belady")


def test_scheduler_refuses_completing_a_load_that_is_not_in_flight():
    run = ServeRun(load_trace(TRACE, limit=2), serve_config(host_num_blocks=100))
    with pytest.raises(RequestStateError, match="no KV load in flight"):
        run.scheduler.complete_kv_loads(["nope"])


# ---------------------------------------------------------------------------- CLI


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_compares_policies_in_one_replay(capsys):
    code, out, _ = run_cli(
        capsys, "--mode", "replay", "--trace", TRACE, "--eviction", "lru,s3fifo,belady",
        "--capacity", "300,1200", "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["config"]["policies"] == ["lru", "s3fifo", "belady"]
    assert [(r["capacity_blocks"], r["policy"]) for r in report["results"]] == [
        (300, "lru"), (300, "s3fifo"), (300, "belady"),
        (1200, "lru"), (1200, "s3fifo"), (1200, "belady"),
    ]  # fmt: skip
    for row in report["summary"]:
        rates = {r["policy"]: r["hit_rate"] for r in report["results"]
                 if r["capacity_blocks"] == row["capacity_blocks"]}  # fmt: skip
        assert row["best_online_hit_rate"] == max(rates["lru"], rates["s3fifo"])
        assert rates["belady"] >= row["best_online_hit_rate"]


def test_cli_text_table_and_serve_with_a_host_tier(capsys):
    code, out, _ = run_cli(
        capsys, "--mode", "replay", "--trace", TRACE, "--eviction", "all",
        "--capacity", "500", "--no-progress",
    )  # fmt: skip
    assert code == 0 and "gap closed" in out and "belady" in out
    code, out, _ = run_cli(
        capsys, "--trace", TRACE, "--num-requests", "20", "--eviction", "cost",
        "--host-capacity", "1Mtok", "--capacity", "600", "--json",
    )  # fmt: skip
    assert code == 0
    report = json.loads(out)
    assert report["config"]["eviction"] == "cost"
    assert report["config"]["host_num_blocks"] == 62_500
    results = report["results"]
    assert results["num_requests_completed"] + results["num_requests_rejected"] == 20
    code, out, _ = run_cli(
        capsys, "--trace", TRACE, "--num-requests", "20", "--eviction", "hazard",
        "--lookahead", "--capacity", "600",
    )  # fmt: skip
    assert code == 0 and "hazard with the waiting-queue look-ahead" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--mode", "replay", "--eviction", "mru"), "unknown policy 'mru'"),
        (("--eviction", "lru,lfu"), "one --eviction policy"),
        (("--eviction", "belady"), "belady needs the future"),
        (("--mode", "replay", "--eviction", "lru", "--capacity", "unlimited"), "unlimited"),
        (("--mode", "replay", "--host-capacity", "1,2"), "one finite size"),
        (("--eviction", "lfu", "--no-prefix-caching"), "need prefix caching"),
        (("--mode", "replay", "--lookahead"), "--lookahead is for --mode serve"),
    ],
)
def test_cli_mistakes_get_one_clear_line(capsys, argv, message):
    code, out, err = run_cli(capsys, "--trace", TRACE, "--num-requests", "5", *argv)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err
