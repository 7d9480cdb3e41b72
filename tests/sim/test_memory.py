"""The memory study (`pagedkv simulate --mode memory`, the no-argument run): load, sizes, answer."""

from __future__ import annotations

import json

import pytest

from pagedkv.cli import main
from pagedkv.errors import InvalidArgumentError
from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cost_model import LinearCostModel, get_profile
from pagedkv.sim.inputs.traces import OUTPUT_TOKEN_BASE, Trace, TraceRequest, load_trace
from pagedkv.sim.memory_study import (
    carried_time_scale,
    estimate_busy_s,
    memory_configs,
    study_memory,
)
from pagedkv.sim.report.memory import memory_report
from pagedkv.sim.serve import ServeConfig, simulate_serving
from tests.support.paths import DATA_DIR

DATA = DATA_DIR
TRACE = DATA / "mooncake_conversations46.jsonl"


def _request(arrival_s: float, num_prompt: int, num_output: int) -> TraceRequest:
    return TraceRequest(
        f"r{arrival_s}", arrival_s, num_prompt, num_output, ((0, num_prompt),), OUTPUT_TOKEN_BASE
    )


def test_busy_time_by_hand():
    # One 10-token prompt in chunks of 4 (reads 4 + 8 + 10 KV tokens), 3 output tokens.
    model = LinearCostModel(
        step_overhead_s=1.0,
        prefill_token_s=10.0,
        decode_seq_s=100.0,
        kv_token_read_s=1000.0,
        prefill_attention_pair_s=10_000.0,
    )
    trace = Trace("t", (_request(0.0, 10, 3),), "test")
    expected = (
        10 * 10.0  # prompt tokens
        + 55 * 10_000.0  # 10 * 11 / 2 causal pairs
        + 22 * 1000.0  # KV read by the chunks
        + 3 * 100.0  # decodes
        + 3 * (10 + 1.5) * 1000.0  # KV read by the decodes (mean context)
        + 13 / 4 * 1.0  # one step overhead per 4 scheduled tokens
    )
    assert estimate_busy_s(trace, model, 4) == pytest.approx(expected)


def test_carried_time_scale_rounds_up_to_two_digits():
    model = LinearCostModel(0.0, 1.0, 0.0, 0.0)  # one second per prompt token
    trace = Trace("t", (_request(0.0, 300, 1), _request(100.0, 137, 1)), "test")
    # 437 s of work over 100 s: busy 70 % at 437 / 70 = 6.24..., rounded up to 6.3.
    assert carried_time_scale(trace, model, 8192) == 6.3
    assert carried_time_scale(trace, model, 8192, busy_fraction=1.0) == 4.4
    light = Trace("t", (_request(0.0, 3, 1), _request(100.0, 3, 1)), "test")
    assert carried_time_scale(light, model, 8192) == 1.0  # never faster than the trace
    assert carried_time_scale(trace, model, 8192, busy_fraction=437 / 630) == 6.3
    heavy = Trace("t", (_request(0.0, 123_456, 1), _request(100.0, 1, 1)), "test")
    assert carried_time_scale(heavy, model, 8192, busy_fraction=1.0) == 1300.0
    with pytest.raises(InvalidArgumentError):
        carried_time_scale(trace, model, 8192, busy_fraction=0.0)


def _base_config() -> ServeConfig:
    return ServeConfig(
        num_blocks=1,
        cost_model=get_profile("llama3.1-8b-h100").cost_model(),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048),
        time_scale=0.2,
    )


def test_each_size_is_a_plain_serve_run_in_or_out_of_process():
    trace = load_trace(TRACE)
    configs = memory_configs(_base_config(), [600, 4000], max_model_len=40_000)
    assert [c.max_model_len for c in configs] == [9600, 40_000]
    assert [c.scheduler.max_model_len for c in configs] == [9600, 40_000]
    in_process = study_memory(trace, configs)
    seen: list[int] = []
    assert study_memory(trace, configs, seen.append, max_workers=2) == in_process
    assert seen[-1] == len(trace.requests) and seen == sorted(seen)
    assert in_process[0].summary == simulate_serving(trace, configs[0]).summary
    # The smallest pool preempts and rejects the prompts it cannot hold; the largest neither.
    small, large = (point.summary for point in in_process)
    assert small["num_requests_rejected"] > 0 and small["preemptions"]["num_preemptions"] > 0
    assert large["num_requests_rejected"] == 0


def test_report_answers_with_the_smallest_size_as_fast_as_the_largest():
    trace = load_trace(TRACE)
    configs = memory_configs(_base_config(), [600, 4000, 8000], max_model_len=16_000)
    points = study_memory(trace, configs)
    profile = {"name": "p", "kv_bytes_per_token": 1024, "gpu_num_blocks": 4000}
    report = memory_report(trace, configs, points, profile, "as given")
    results = report["results"]
    assert [r["kv_memory_bytes"] for r in results] == [n * 16 * 1024 for n in (600, 4000, 8000)]
    # Prompts of 16,000 tokens or more are rejected at every size, longer than 9,600 at 600.
    assert [r["num_requests_rejected"] for r in results] == [19, 11, 11]
    assert [r["num_preemptions"] for r in results] == [2, 0, 0]
    assert [r["hit_rate"] for r in results] == [0.390211, 0.624945, 0.626821]
    assert results[1]["ttft_s"]["p50"] == results[2]["ttft_s"]["p50"]
    assert report["needs_num_blocks"] == 4000
    json.dumps(report)  # JSON-ready


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_memory_mode_json_and_plot(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    args = ("--mode", "memory", "--trace", str(TRACE), "--num-requests", "20")
    args += ("--capacity", "600,4000", "--json")
    code, out, err = run_cli(capsys, *args, "--plot", str(png))
    assert code == 0 and f"wrote {png}" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out)
    assert report["mode"] == "memory" and "plot" not in report
    assert [r["num_blocks"] for r in report["results"]] == [600, 4000]
    assert report["config"]["time_scale"] == carried_time_scale(
        load_trace(TRACE, limit=20), get_profile("llama3.1-8b-h100").cost_model(), 8192
    )
    assert run_cli(capsys, *args)[1] == out  # deterministic, and no plot without --plot


def test_memory_mode_usage_errors(capsys):
    code, _, err = run_cli(capsys, "--mode", "memory", "--capacity", "100,unlimited")
    assert code == 2 and "unlimited" in err
    code, _, err = run_cli(
        capsys, "--mode", "memory", "--model", "llama-3.1-8b", "--memory", "1GiB"
    )
    assert code == 2 and "--mode serve" in err


def test_options_other_than_output_select_serve(capsys):
    code, out, _ = run_cli(capsys, "--trace", str(TRACE), "--capacity", "3000", "--json")
    assert code == 0 and json.loads(out)["mode"] == "serve"
    code, out, _ = run_cli(capsys, "--trace", str(TRACE), "--instances", "2", "--json")
    assert code == 0 and json.loads(out)["mode"] == "cluster"


def test_a_trace_alone_keeps_the_memory_study(capsys):
    """`--trace FILE` (and the workload, scheduler and size options) keep the main job."""
    args = ("--trace", str(TRACE), "--num-requests", "12", "--max-num-seqs", "64", "--json")
    code, out, _ = run_cli(capsys, *args)
    report = json.loads(out)
    assert code == 0 and report["mode"] == "memory"
    assert report["trace"]["num_requests"] == 12
    assert report["config"]["scheduler"]["max_num_seqs"] == 64
    assert len(report["results"]) == 4  # the four default sizes
    code, out, _ = run_cli(capsys, *args[:4], "--capacity", "2000,4000", "--json")
    assert [r["num_blocks"] for r in json.loads(out)["results"]] == [2000, 4000]


@pytest.mark.timeout(300)
def test_no_argument_run_is_the_memory_study(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "80")  # an 80-column terminal: the table fits, uncut
    code, out, err = run_cli(capsys)
    lines = out.splitlines()
    assert code == 0
    assert max(map(len, lines)) <= 80 and "…" not in out
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["KV", "memory"])
    assert lines[header].split() == "KV memory KV hit TTFT TTFT TPOT e2e pre- re-".split()
    assert (
        lines[header + 1].split()
        == "GiB tokens rate % p50 s p90 s p50 ms p50 s empted jected".split()
    )
    rows = [line.split() for line in lines[header + 3 : header + 7]]
    assert [row[:2] for row in rows] == [
        ["12.6", "102,880"], ["25.1", "205,760"], ["50.2", "411,520"], ["100.5", "823,040"]
    ]  # fmt: skip
    assert all(len(row) == 9 for row in rows)  # every number whole, one per column
    out = " ".join(out.split())  # the notes wrap at 80 columns
    assert "pagedkv simulate (memory): mooncake_conversation_sample.jsonl: 300 requests" in out
    for needle in ("answer 50.2 GiB", "simulator speed"):
        assert needle in out
    if (tmp_path / "pagedkv-memory.png").exists():
        assert "plot pagedkv-memory.png" in out and "wrote pagedkv-memory.png" in err


def test_the_plot_shows_hit_rate_from_zero_ttft_counts_and_the_answer(capsys):
    pytest.importorskip("matplotlib")
    from pagedkv.sim.report.plot import _pyplot, memory_figure

    code, out, _ = run_cli(capsys, "--trace", str(TRACE), "--num-requests", "20", "--json")
    assert code == 0
    report = json.loads(out)
    results = report["results"]
    plt = _pyplot()
    figure = memory_figure(report, plt)
    try:
        hit_axes, ttft_axes, count_axes = figure.axes
        assert hit_axes.get_ylim()[0] == 0 and ttft_axes.get_ylim()[0] == 0  # honest axes
        hit_line = hit_axes.get_lines()[0]
        assert list(hit_line.get_ydata()) == [100 * r["hit_rate"] for r in results]
        assert [line.get_label() for line in ttft_axes.get_lines()][:2] == ["TTFT p50", "TTFT p90"]
        heights = [round(patch.get_height()) for patch in count_axes.patches]
        preempted = [r["num_preemptions"] for r in results]
        rejected = [r["num_requests_rejected"] for r in results]
        assert heights == preempted + rejected
        answer = next(r for r in results if r["num_blocks"] == report["needs_num_blocks"])
        for axes in figure.axes:
            marks = [line for line in axes.get_lines() if line.get_label() == "answer"]
            assert [line.get_xdata()[0] for line in marks] == [answer["kv_memory_bytes"] / 2**30]
    finally:
        plt.close(figure)
