"""Serve mode with exact, hand-checked timings; the cost model and its profiles."""

from __future__ import annotations

import json

import pytest

from pagedkv.errors import ConfigError
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import (
    PROFILES,
    LinearCostModel,
    get_profile,
    parse_cost_overrides,
)
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.serve import ServeConfig, ServeRun, percentile, simulate_serving
from tests.support.paths import DATA_DIR

ONE_SECOND_PER_STEP = LinearCostModel(1.0, 0.0, 0.0, 0.0)


def trace_of(tmp_path, records):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return load_trace(path)


def serve_config(**overrides) -> ServeConfig:
    values = dict(
        num_blocks=40,
        cost_model=ONE_SECOND_PER_STEP,
        scheduler=SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=4),
        block_size=4,
        max_model_len=64,
    )
    values.update(overrides)
    return ServeConfig(**values)


def test_latencies_follow_the_steps_exactly(tmp_path):
    trace = trace_of(
        tmp_path,
        [
            {"prompt_token_ids": list(range(10)), "output_length": 3, "timestamp": 0},
            {"prompt_token_ids": list(range(10)), "output_length": 1, "timestamp": 10_000},
            {"input_length": 70, "output_length": 1, "timestamp": 10_000},  # > max_model_len
        ],
    )
    result = simulate_serving(trace, serve_config())
    summary = result.summary
    # Request 1: steps [0,1) and [1,2) prefill 8 + 2 tokens, first token at t=2, then decode
    # steps end at 3 and 4. Idle until t=10; request 2 hits 8 cached tokens, computes 2 in
    # [10, 11) and finishes with its only token.
    assert list(result.step_start_s) == [0.0, 1.0, 2.0, 3.0, 10.0]
    assert summary["ttft_s"] == {
        "count": 2,
        "mean": 1.5,
        "p50": 1.5,
        "p90": 1.9,
        "p99": 1.99,
        "max": 2.0,
    }
    assert summary["tpot_s"]["count"] == 1 and summary["tpot_s"]["max"] == 1.0
    assert summary["e2e_latency_s"]["max"] == 4.0
    assert summary["simulated_time_s"] == 11.0
    assert (summary["num_requests_completed"], summary["num_requests_rejected"]) == (2, 1)
    assert summary["prefix_cache"] == {
        "queries": 20,
        "hits": 8,
        "hit_rate": 0.4,
        "preempted_queries": 0,
        "preempted_hits": 0,
    }
    assert summary["tokens"] == {
        "prompt": 20,
        "output": 4,
        "prefill_computed": 12,
        "decode_computed": 2,
    }
    # Usage: blocks in use of 40 (request 2 holds 2 hit blocks and 1 new); idle time counts 0.
    assert list(result.step_usage) == pytest.approx([2 / 40, 3 / 40, 3 / 40, 3 / 40, 3 / 40])
    assert summary["usage"]["mean"] == pytest.approx((2 + 3 + 3 + 3 + 3) / 40 / 11, rel=1e-5)
    assert summary["num_running"] == {"peak": 1, "mean": pytest.approx(5 / 11, rel=1e-5)}


def test_time_scale_stretches_arrivals(tmp_path):
    trace = trace_of(
        tmp_path,
        [
            {"prompt_token_ids": [1, 2, 3], "output_length": 1, "timestamp": 0},
            {"prompt_token_ids": [4, 5, 6], "output_length": 1, "timestamp": 4_000},
        ],
    )
    result = simulate_serving(trace, serve_config(time_scale=0.5))
    assert list(result.step_start_s) == [0.0, 2.0]


def test_preemptions_are_counted_and_rehit(tmp_path):
    records = [
        {"prompt_token_ids": list(range(100 * i, 100 * i + 8)), "output_length": 12, "timestamp": 0}
        for i in range(3)
    ]
    config = serve_config(
        num_blocks=9, max_model_len=20, scheduler=SchedulerConfig(max_num_batched_tokens=32)
    )
    summary = simulate_serving(trace_of(tmp_path, records), config).summary
    assert summary["num_requests_completed"] == 3
    assert summary["preemptions"]["num_preemptions"] >= 1
    assert summary["prefix_cache"]["preempted_queries"] > 0
    assert summary["tokens"]["prefill_computed"] > 24  # recomputation after preemption
    assert summary["usage"]["peak"] == 1.0


def test_percentile_interpolates_linearly():
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.9) == pytest.approx(3.7)
    assert percentile([5.0], 0.99) == 5.0
    assert percentile([], 0.5) == 0.0


def test_serve_config_validation():
    with pytest.raises(ConfigError, match="policy"):
        serve_config(policy="lifo")
    with pytest.raises(ConfigError, match="time_scale"):
        serve_config(time_scale=0)


def test_profile_coefficients_follow_the_roofline_formulas():
    profile = get_profile("llama3.1-8b-h100")
    model = profile.cost_model()
    assert profile.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert model.step_overhead_s == pytest.approx(8.03e9 * 2 / (3.35e12 * 0.8))
    assert model.prefill_token_s == pytest.approx(2 * 8.03e9 / (989.4e12 * 0.5))
    assert model.kv_token_read_s == pytest.approx(131072 / (3.35e12 * 0.8))
    assert model.prefill_attention_pair_s == pytest.approx(4 * 32 * 32 * 128 / (989.4e12 * 0.5))
    assert profile.num_kv_blocks(16) == int((80e9 * 0.9 - 2e9 - 16.06e9) // (131072 * 16))
    assert get_profile("llama3.1-70b-h100x4").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    for each in PROFILES.values():
        assert each.num_kv_blocks(16) > each.max_model_len // 16  # one longest request fits
    with pytest.raises(ConfigError, match="unknown profile"):
        get_profile("gpt-5-on-a-toaster")


def test_cost_model_arithmetic_and_overrides():
    model = LinearCostModel(0.01, 1e-4, 2e-4, 1e-6, 1e-9)

    class Record:
        num_prefill_tokens = 100
        num_decode_tokens = 3
        num_kv_tokens_read = 1000
        num_prefill_attention_pairs = 5000

    assert model.step_time_s(Record) == pytest.approx(0.01 + 0.01 + 6e-4 + 1e-3 + 5e-6)
    overrides = parse_cost_overrides("step_overhead_s=0.5, decode_seq_s=0")
    assert overrides == {"step_overhead_s": 0.5, "decode_seq_s": 0.0}
    assert model.with_overrides(overrides).step_overhead_s == 0.5
    with pytest.raises(ConfigError, match="unknown cost coefficient"):
        model.with_overrides({"warp_speed": 1.0})
    with pytest.raises(ConfigError, match="not name=value"):
        parse_cost_overrides("fast")
    with pytest.raises(ConfigError, match=">= 0"):
        LinearCostModel(-1.0, 0.0, 0.0, 0.0)


def test_deferred_arrivals_change_nothing():
    # Overloaded (every arrival at once, 3 sequences a step, a small pool with preemptions):
    # building requests only as the waiting queue drains gives the very same run.
    trace = load_trace(DATA_DIR / "mooncake_conversations46.jsonl")
    config = ServeConfig(
        num_blocks=700,
        cost_model=get_profile("llama3.1-8b-h100").cost_model(),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=3),
        max_model_len=700 * 16,
        time_scale=0.001,
    )
    summaries, runs = [], []
    for defer in (True, False):
        run = ServeRun(trace, config, defer_arrivals=defer)
        run.run(None)
        summaries.append(run.summary())
        runs.append(run)
    assert summaries[0] == summaries[1]
    assert summaries[0]["num_waiting"]["peak"] > 20
    assert summaries[0]["preemptions"]["num_preemptions"] > 0
    assert list(runs[0].result.step_num_waiting) == list(runs[1].result.step_num_waiting)
