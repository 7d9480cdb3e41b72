"""Serve mode on vLLM 0.33's own Scheduler (`pagedkv.sim.vllm_serve`): the same report as the
reference scheduler's, on pagedkv's manager and on vLLM's; async scheduling one batch ahead;
the settings it refuses. Needs the `[vllm]` extra: `.ci/vllm-suites` runs it in its vLLM venv;
elsewhere it is skipped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

# First: without vLLM, skip before importing torch (as tests/test_integration_vllm.py does; the
# reason avoids strict_setup's "could not import", this skip is expected under `make test`).
vllm = pytest.importorskip("vllm", reason="no vLLM in this venv: .ci/vllm-suites runs this")

from pagedkv.errors import ConfigError  # noqa: E402
from pagedkv.sched import SchedulerConfig  # noqa: E402
from pagedkv.sim.cost_model import LinearCostModel, get_profile  # noqa: E402
from pagedkv.sim.inputs.traces import load_trace  # noqa: E402
from pagedkv.sim.serve import ServeConfig, simulate_serving  # noqa: E402
from pagedkv.sim.vllm_options import VllmOptions  # noqa: E402
from pagedkv.sim.vllm_serve import simulate_serving_vllm  # noqa: E402
from tests.support.paths import DATA_DIR  # noqa: E402

COST = get_profile("llama3.1-8b-h100").cost_model()
# Round numbers, so the step times of the async scenario can be added up by hand.
SIMPLE_COST = LinearCostModel(
    step_overhead_s=0.01, prefill_token_s=0.001, decode_seq_s=0.002, kv_token_read_s=0.0
)


def tight_config(**overrides) -> ServeConfig:
    """head40 at 20x its rate in 1,200 blocks: queues, rejections and two preemptions."""
    settings = {
        "num_blocks": 1200,
        "cost_model": COST,
        "scheduler": SchedulerConfig(max_model_len=19200),
        "max_model_len": 19200,
        "time_scale": 0.05,
    }
    return ServeConfig(**{**settings, **overrides})


@pytest.fixture(scope="module")
def head40():
    return load_trace(DATA_DIR / "mooncake_head40.jsonl")


@pytest.fixture(scope="module")
def reference(head40):
    return simulate_serving(head40, tight_config()).summary


@pytest.mark.parametrize("kv_manager", ["pagedkv", "vllm"])
def test_vllms_scheduler_serves_as_the_reference_scheduler_does(head40, reference, kv_manager):
    summary = simulate_serving_vllm(head40, tight_config(), VllmOptions(kv_manager)).summary
    assert reference["preemptions"] == {"num_preemptions": 2, "num_requests_preempted": 2}
    assert reference["num_requests_rejected"] > 0 and reference["prefix_cache"]["hits"] > 0
    assert summary == reference  # every latency, count, hit and the whole timeline


def write_trace(path: Path, requests: list[dict]) -> Path:
    path.write_text("".join(json.dumps(request) + "\n" for request in requests))
    return path


def test_async_scheduling_schedules_one_batch_ahead(tmp_path):
    # r1 arrives at 0, r2 at 1 ms. Without async scheduling r2 joins the second batch, after
    # r1's prefill (0.01 + 100 x 0.001 = 0.11 s): its prompt and r1's first decode take 0.112 s,
    # so r2's first token comes at 0.222 s, 0.221 s after it arrived. With async scheduling
    # the second batch was scheduled at 0, before r2 arrived (r1's decode alone, 0.012 s);
    # r2 joins the third, which starts at 0.122 s: its first token 0.012 s later.
    trace = load_trace(
        write_trace(
            tmp_path / "two.jsonl",
            [
                {"timestamp": 0, "input_length": 100, "output_length": 5},
                {"timestamp": 1, "input_length": 100, "output_length": 2},
            ],
        )
    )
    config = ServeConfig(num_blocks=100, cost_model=SIMPLE_COST, max_model_len=1600)
    summaries = {
        async_scheduling: simulate_serving_vllm(
            trace, config, VllmOptions(async_scheduling=async_scheduling)
        ).summary
        for async_scheduling in (False, True)
    }
    sync, ahead = summaries[False], summaries[True]
    assert (sync["ttft_s"]["p50"], sync["ttft_s"]["max"]) == (pytest.approx(0.1655), 0.221)
    assert ahead["ttft_s"]["max"] == 0.233
    assert sync == simulate_serving(trace, config).summary  # the reference agrees without async
    for summary in summaries.values():
        assert summary["num_requests_completed"] == 2
        assert summary["tokens"]["output"] == 7 and summary["tokens"]["decode_computed"] == 5


def test_a_lone_long_prompt_is_not_capped_by_vllm(tmp_path):
    # vLLM lifts long_prefill_token_threshold when a request is the only one (nobody to starve);
    # the reference scheduler caps it anyway: 2,000 prompt tokens in one step instead of four.
    trace = load_trace(
        write_trace(tmp_path / "one.jsonl", [{"input_length": 2000, "output_length": 3}])
    )
    config = ServeConfig(
        num_blocks=1000,
        cost_model=SIMPLE_COST,
        max_model_len=16000,
        scheduler=SchedulerConfig(long_prefill_token_threshold=512, max_model_len=16000),
    )
    assert simulate_serving_vllm(trace, config, VllmOptions()).summary["num_steps"] == 1 + 2
    assert simulate_serving(trace, config).summary["num_steps"] == 4 + 2


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eviction": "s3fifo"}, "eviction policies other than lru"),
        ({"host_num_blocks": 100}, "a host-memory tier"),
        ({"scheduler": SchedulerConfig(async_caching=True)}, "vLLM's counterpart is --async-sched"),
        ({"enable_kv_cache_events": True}, "KV-cache events"),
    ],
)
def test_settings_vllm_is_not_driven_with_are_refused(head40, overrides, message):
    with pytest.raises(ConfigError, match=f"--scheduler vllm does not support .*{message}"):
        simulate_serving_vllm(head40, tight_config(**overrides), VllmOptions())


def test_an_unknown_manager_is_refused():
    with pytest.raises(ConfigError, match="kv_manager must be one of"):
        VllmOptions(kv_manager="sglang")
