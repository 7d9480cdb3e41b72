"""`pagedkv simulate` end to end, in process."""

from __future__ import annotations

import builtins
import json

import pytest

from pagedkv.cli import main
from pagedkv.sim.report import render_text
from tests.support.paths import DATA_DIR

DATA = DATA_DIR
TRACE = str(DATA / "mooncake_conversations46.jsonl")


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.timeout(120)
def test_serve_mode_serves_the_shipped_sample(capsys):
    # The packaged 1,000-request Mooncake sample, default profile (the no-argument run before
    # the memory study became the default: tests/sim/test_memory.py).
    code, out, _ = run_cli(capsys, "--mode", "serve")
    out = " ".join(out.split())  # the table may wrap long lines
    assert code == 0
    assert "mooncake_conversation_sample.jsonl: 1,000 requests, 13,732,944 prompt tokens" in out
    assert "1,000 completed" in out
    for needle in (
        "TTFT (s)",
        "TPOT (ms)",
        "prefix cache",
        "preemptions",
        "KV usage",
        "waiting over time",
        "simulated prompt tokens/s",
    ):
        assert needle in out


def test_json_is_byte_identical_across_runs(capsys):
    args = ("--trace", TRACE, "--num-requests", "20", "--json", "--capacity", "2000")
    first = run_cli(capsys, *args)
    second = run_cli(capsys, *args)
    assert first[0] == second[0] == 0
    assert first[1] == second[1]
    report = json.loads(first[1])
    assert report["trace"]["num_requests"] == 20
    assert report["results"]["num_requests_completed"] == 20
    assert "prompt tokens in" in first[2]  # the speed goes to stderr, never into the JSON


def test_workload_json_is_deterministic(capsys):
    args = (
        "--workload",
        "chat",
        "--num-requests",
        "40",
        "--seed",
        "5",
        "--json",
        "--mode",
        "replay",
        "--capacity",
        "1000,unlimited",
    )
    first, second = run_cli(capsys, *args), run_cli(capsys, *args)
    assert first[1] == second[1]
    results = json.loads(first[1])["results"]
    assert results[1]["hit_rate"] >= results[0]["hit_rate"] > 0


def test_replay_table(capsys):
    code, out, _ = run_cli(
        capsys, "--trace", TRACE, "--mode", "replay", "--capacity", "500,128ktok,unlimited"
    )
    assert code == 0
    assert "capacity (blocks)" in out and "unlimited" in out
    assert "8,000" in out and "128,000" in out  # 128k tokens = 8,000 blocks of 16


def test_plot_files(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    for mode, extra in (("replay", ["--capacity", "500,2000"]), ("serve", ["--capacity", "3000"])):
        png = tmp_path / f"{mode}.png"
        code, _, err = run_cli(
            capsys,
            "--trace",
            TRACE,
            "--num-requests",
            "10",
            "--mode",
            mode,
            "--plot",
            str(png),
            *extra,
        )
        assert code == 0 and f"wrote {png}" in err
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_malformed_trace_is_reported_and_nothing_is_simulated(capsys, tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}'
    bad.write_text(
        good + "\n" + '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n'
    )
    code, out, err = run_cli(capsys, "--trace", str(bad))
    assert code == 2
    assert out == ""
    assert f"{bad}:2: field 'hash_ids'" in err


def test_unsorted_trace_warns_on_stderr(capsys, tmp_path):
    path = tmp_path / "unsorted.jsonl"
    path.write_text(
        '{"prompt_token_ids": [1, 2, 3], "output_length": 1, "timestamp": 5}\n'
        '{"prompt_token_ids": [1, 2, 4], "output_length": 1, "timestamp": 1}\n'
    )
    code, _, err = run_cli(capsys, "--trace", str(path), "--json", "--capacity", "100")
    assert code == 0 and "warning:" in err and "not sorted" in err


def test_usage_errors(capsys):
    # Several serve capacities are a sweep (tests/cli/test_simulate_sweep.py); unlimited is not.
    code, _, err = run_cli(
        capsys, "--mode", "serve", "--trace", TRACE, "--capacity", "100,unlimited"
    )
    assert code == 2 and "serve cells take finite capacities" in err
    assert run_cli(capsys, "--mode", "replay", "--profile", "llama3.1-8b-h100")[0] == 2
    # A small pool lowers the default max_model_len; longer prompts are rejected, not fatal.
    code, out, _ = run_cli(capsys, "--trace", TRACE, "--capacity", "100", "--json")
    assert code == 0
    results = json.loads(out)["results"]  # 1,600-token pool: only the 1,066-token prompt fits
    assert (results["num_requests_completed"], results["num_requests_rejected"]) == (1, 45)
    code, _, err = run_cli(capsys, "--trace", TRACE, "--capacity", "100", "--max-model-len", "9000")
    assert code == 2 and "cannot hold one request" in err
    code, _, err = run_cli(capsys, "--trace", "/nonexistent/trace.jsonl")
    assert code == 2 and "nonexistent" in err


def test_list_profiles(capsys):
    code, out, _ = run_cli(capsys, "--list-profiles")
    assert code == 0
    assert "llama3.1-8b-h100" in out and "qwen2.5-7b-a100" in out and "kv_token_read_s" in out


def test_plain_text_report_without_rich(capsys, monkeypatch):
    real_import = builtins.__import__

    def no_rich(name, *args, **kwargs):
        if name.startswith("rich"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_rich)
    code, out, _ = run_cli(capsys, "--trace", TRACE, "--num-requests", "12", "--capacity", "3000")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("pagedkv simulate (serve): mooncake_conversations46.jsonl: 12")
    assert lines[2].split() == ["latency", "mean", "p50", "p90", "p99", "max"]
    assert lines[3].startswith("-")


def test_render_text_ascii_fallback():
    report = json.loads((DATA / "golden_serve.json").read_text())
    text = render_text(report, ascii_only=True)
    assert text.isascii()
    assert "usage over time" in text
