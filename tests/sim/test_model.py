"""The simulator with a real model's KV-cache groups (`simulate --model`), serve and replay."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import DEFAULT_PROFILE, get_profile
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.replay import replay
from pagedkv.sim.serve import ServeConfig, ServeRun, simulate_serving
from pagedkv.sizing import estimate_max_model_len, get_kv_cache_layout, size_kv_cache
from pagedkv.sizing.model_config import load_model_description
from pagedkv.specs import KVCacheConfig
from tests.support.paths import DATA_DIR

TRACE_PATH = DATA_DIR / "mooncake_conversations46.jsonl"
GIB = 2**30
GEMMA_GROUPS = [("sliding_window", 16)] * 5 + [("full_attention", 16)]
MAX_NUM_BATCHED_TOKENS = 8192


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE_PATH)


def sized(model: str, memory_bytes: int, max_model_len: int, max_in_flight_tokens=None):
    description = load_model_description(model)
    return size_kv_cache(
        description.layer_to_spec,
        memory_bytes,
        max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
    )


def model_serve_config(kv_cache_config: KVCacheConfig | None, num_blocks: int, max_model_len: int):
    return ServeConfig(
        num_blocks=num_blocks,
        cost_model=get_profile(DEFAULT_PROFILE).cost_model(),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=max_model_len
        ),
        block_size=16,
        max_model_len=max_model_len,
        time_scale=0.05,  # 20x the trace's rate, so requests overlap and compete for blocks
        kv_cache_config=kv_cache_config,
    )


def group_kinds(manager) -> list[tuple[str, int]]:
    return [
        (group.kv_cache_spec.kind, group.kv_cache_spec.block_size)
        for group in manager.kv_cache_config.kv_cache_groups
    ]


def test_serve_with_gemma_uses_its_hybrid_groups(trace):
    max_model_len = 16384
    sizing = sized("gemma-3-12b-it", 4 * GIB, max_model_len, MAX_NUM_BATCHED_TOKENS)
    config = model_serve_config(sizing.kv_cache_config, sizing.num_blocks - 1, max_model_len)
    run = ServeRun(trace, config)
    assert group_kinds(run.manager) == GEMMA_GROUPS
    assert run.manager.hash_block_size == 16
    assert run.manager.max_in_flight_tokens == MAX_NUM_BATCHED_TOKENS
    assert run.manager.block_pool.get_num_free_blocks() == sizing.num_blocks - 1
    run.run(None)
    summary = run.summary()
    num_too_long = sum(1 for r in trace.requests if r.num_prompt_tokens >= max_model_len)
    assert num_too_long > 0  # the rejection rule is exercised
    assert summary["num_requests_rejected"] == num_too_long
    assert summary["num_requests_completed"] == len(trace.requests) - num_too_long
    cache = summary["prefix_cache"]
    assert 0 < cache["hits"] <= cache["queries"]
    assert cache["hits"] % 16 == 0  # hits are whole blocks of the one block size
    run.scheduler.check_invariants()
    # Every request finished: the whole pool is free again (cached blocks stay evictable).
    assert run.manager.block_pool.get_num_free_blocks() == sizing.num_blocks - 1


def test_serve_with_llama_equals_the_synthetic_run(trace):
    max_model_len = 16384
    sizing = sized("llama-3.1-8b", 4 * GIB, max_model_len, MAX_NUM_BATCHED_TOKENS)
    assert [g.kv_cache_spec.kind for g in sizing.kv_cache_config.kv_cache_groups] == [
        "full_attention"
    ]
    num_blocks = sizing.num_blocks - 1
    with_model = simulate_serving(
        trace, model_serve_config(sizing.kv_cache_config, num_blocks, max_model_len)
    )
    synthetic = simulate_serving(trace, model_serve_config(None, num_blocks, max_model_len))
    assert with_model.summary == synthetic.summary
    assert with_model.summary["prefix_cache"]["hits"] > 0


def test_serve_config_rejects_a_pool_size_mismatch():
    sizing = sized("llama-3.1-8b", 4 * GIB, 4096)
    with pytest.raises(ConfigError, match="num_blocks"):
        model_serve_config(sizing.kv_cache_config, sizing.num_blocks, 4096)


def test_replay_with_gemma_never_beats_the_unlimited_full_attention_ceiling(trace):
    groups = get_kv_cache_layout(load_model_description("gemma-3-12b-it").layer_to_spec).groups
    capacities = [2000, 8000, 16383]
    points = replay(trace, capacities, kv_cache_groups=groups)
    (ceiling,) = replay(trace, [None])
    for point in points:
        # A hybrid hit needs the full group's hit, which needs every block of the prefix
        # seen before: the unlimited full-attention cache hits at least as much.
        assert point.num_hit_tokens <= ceiling.num_hit_tokens
        assert point.num_hit_tokens % 16 == 0
    # More blocks never fit fewer prompts; 500 blocks shared by six groups fit almost none.
    assert [p.num_requests_not_fit for p in points] == sorted(
        (p.num_requests_not_fit for p in points), reverse=True
    )
    assert points[-1].num_requests_not_fit == 0
    assert points[-1].num_hit_tokens > 0
    with pytest.raises(InvalidArgumentError, match="unlimited"):
        replay(trace, [1000, None], kv_cache_groups=groups)


def test_replay_with_llama_equals_the_synthetic_replay(trace):
    groups = get_kv_cache_layout(load_model_description("llama-3.1-8b").layer_to_spec).groups
    capacities = [500, 2000, 8000]
    assert replay(trace, capacities, kv_cache_groups=groups) == replay(trace, capacities)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", "--trace", str(TRACE_PATH), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_serve_with_gemma_reports_its_groups(capsys, trace):
    code, out, _ = run_cli(capsys, "--model", "gemma-3-12b-it", "--memory", "4GiB", "--json")
    assert code == 0
    report = json.loads(out)
    config = report["config"]
    assert config["model"] == "gemma-3-12b-it"
    assert config["profile"] == DEFAULT_PROFILE  # the cost model stays the profile's
    assert [(g["kind"], g["block_size"]) for g in config["kv_cache_groups"]] == GEMMA_GROUPS
    assert [g.get("sliding_window") for g in config["kv_cache_groups"]] == [1024] * 5 + [None]
    assert config["capacity_tokens"] is None
    # num_blocks and max_model_len are what sizing gives for 4 GiB, capped by the profile.
    layer_to_spec = load_model_description("gemma-3-12b-it").layer_to_spec
    max_model_len = estimate_max_model_len(
        get_kv_cache_layout(layer_to_spec),
        4 * GIB,
        get_profile(DEFAULT_PROFILE).max_model_len,
        max_in_flight_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    sizing = sized("gemma-3-12b-it", 4 * GIB, max_model_len, MAX_NUM_BATCHED_TOKENS)
    assert config["max_model_len"] == max_model_len
    assert config["num_blocks"] == sizing.num_blocks - 1
    results = report["results"]
    assert results["num_requests_completed"] + results["num_requests_rejected"] == len(
        trace.requests
    )
    # The table names the layout and the cost model.
    code, out, _ = run_cli(capsys, "--model", "gemma-3-12b-it", "--memory", "4GiB", "--no-progress")
    text = " ".join(out.split())
    assert "KV layout from gemma-3-12b-it, cost model llama3.1-8b-h100" in text
    assert "5 x sliding_window(1024)/16, full_attention/16" in text


def test_cli_replay_with_gemma(capsys):
    code, out, _ = run_cli(
        capsys, "--mode", "replay", "--model", "gemma-3-12b-it", "--capacity", "2000,8000", "--json"
    )
    assert code == 0
    report = json.loads(out)
    assert report["config"]["model"] == "gemma-3-12b-it"
    assert [r["capacity_blocks"] for r in report["results"]] == [2000, 8000]
    assert [r["capacity_tokens"] for r in report["results"]] == [None, None]
    # With --memory instead, one point at the sized pool (the null block aside).
    code, out, _ = run_cli(
        capsys, "--mode", "replay", "--model", "gemma-3-12b-it", "--memory", "16GiB", "--json"
    )
    assert code == 0
    longest = max(r.num_prompt_tokens for r in load_trace(TRACE_PATH).requests)
    sizing = sized("gemma-3-12b-it", 16 * GIB, longest)
    assert [r["capacity_blocks"] for r in json.loads(out)["results"]] == [sizing.num_blocks - 1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--memory", "4GiB"], "--memory sizes the KV cache of a --model"),
        (["--model", "llama-3.1-8b"], "takes --memory"),
        (["--model", "llama-3.1-8b", "--memory", "4GiB", "--capacity", "100"], "takes --memory"),
        (["--model", "llama-3.1-8b", "--memory", "4 parsecs"], "--memory '4 parsecs'"),
        (["--model", "no-such-model", "--memory", "4GiB"], "no-such-model"),
        (
            ["--mode", "replay", "--model", "llama-3.1-8b", "--capacity", "10,unlimited"],
            "unlimited",
        ),
        (
            ["--mode", "replay", "--model", "llama-3.1-8b", "--capacity", "10", "--memory", "1GiB"],
            "not both",
        ),
    ],
)
def test_cli_bad_model_arguments_exit_2(capsys, argv, message):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert out == ""
    assert message in err
