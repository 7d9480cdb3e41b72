"""Every CLI mistake gets one clear line and a non-zero exit, checked before any long work; no
silent wrong answers; Ctrl-C reports what was measured. In process via `main()` where
possible, as a real process where a signal, a resource limit or a missing module is the case."""

from __future__ import annotations

import json
import os
import pty
import resource
import select
import signal
import subprocess
import sys
import time

import pytest

from pagedkv import memory_guard
from pagedkv.cli import main
from tests.support.paths import DATA_DIR, SRC_DIR

DATA = DATA_DIR
TRACE = str(DATA / "mooncake_conversations46.jsonl")
SRC = SRC_DIR
GIB = 2**30


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_error_line(err: str) -> str:
    """The single line a mistake prints (anything else fails the test)."""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def run_process(*args: str, preexec=None, code_before: str = "") -> subprocess.CompletedProcess:
    """`pagedkv ARGS` in a fresh interpreter (after running `code_before` in it)."""
    program = (
        f"import sys\n{code_before}\nfrom pagedkv.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    return subprocess.run(
        [sys.executable, "-c", program, *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        preexec_fn=preexec,
        timeout=120,
    )


# ---------------------------------------------------------------------------- usage errors


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-model-len", "0"], "argument --max-model-len: must be >= 1, got 0"),
        (["--num-requests", "0"], "argument --num-requests: must be >= 1, got 0"),
        (["--block-size", "0"], "argument --block-size: must be >= 1, got 0"),
        (["--block-size", "x"], "argument --block-size: expected an integer, got 'x'"),
        (["--time-scale", "0"], "argument --time-scale: must be a finite number > 0, got 0"),
        (["--time-scale", "inf"], "argument --time-scale: must be a finite number > 0, got inf"),
        (["--rate", "nan"], "argument --rate: must be a finite number > 0, got nan"),
        (["--watermark", "1"], "argument --watermark: must be a finite number >= 0 and < 1"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be >= 1, got 0"),
        (["--instances", "0"], "argument --instances: must be >= 1, got 0"),
        (["--metrics-port", "70000"], "argument --metrics-port: must be in [0, 65535], got 70000"),
        (
            ["--long-prefill-token-threshold", "-1"],
            "argument --long-prefill-token-threshold: must be >= 0, got -1",
        ),
        (["--mode", "fast"], "argument --mode: invalid choice: 'fast'"),
    ],
)
def test_bad_arguments_are_one_line(capsys, args, message):
    code, out, err = run_cli(capsys, "simulate", *args)
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert line.startswith(f"pagedkv simulate: error: {message}")
    assert line.endswith("(see pagedkv simulate --help)")


def test_a_binary_trace_is_one_line(capsys, tmp_path):
    png = tmp_path / "plot.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    code, out, err = run_cli(capsys, "simulate", "--trace", str(png))
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        f"pagedkv simulate: error: {png}:1: not UTF-8 text (byte b'\\x89' at column 1); "
        "a trace is a JSONL text file"
    )


# ---------------------------------------------------------------------------- output files


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("out.txt", "unknown format .txt; use one of "),
        ("noext", "no extension to choose the format by; use one of "),
        (".", "is a directory; name a file in it"),
        ("missing/out.png", "directory "),
    ],
)
def test_plot_paths_are_checked_before_the_run(capsys, tmp_path, name, message):
    pytest.importorskip("matplotlib")
    path = tmp_path / name
    # A trace that does not exist: the plot path is refused before the trace is even read.
    code, out, err = run_cli(capsys, "simulate", "--trace", "/no/trace.jsonl", "--plot", str(path))
    assert code == 2 and out == ""
    assert one_error_line(err).startswith(f"pagedkv simulate: error: --plot {path}: {message}")
    assert list(tmp_path.iterdir()) == []


def test_plot_format_follows_the_extension_and_the_report_names_the_file(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    svg = tmp_path / "hit_rate.svg"
    code, _, err = run_cli(
        capsys, "simulate", "--trace", TRACE, "--mode", "replay", "--capacity", "500",
        "--plot", str(svg),
    )  # fmt: skip
    assert code == 0 and f"wrote {svg}" in err
    assert [p.name for p in tmp_path.iterdir()] == ["hit_rate.svg"]
    assert b"<svg" in svg.read_bytes()[:500]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--profile", "nope"], "unknown profile 'nope'; choose one of ["),
        (["--cost", "foo=1"], "unknown cost coefficient(s) ['foo']; known: ["),
        (
            [
                "--cost",
                "step_overhead_s=0,prefill_token_s=0,decode_seq_s=0,kv_token_read_s=0,"
                "prefill_attention_pair_s=0",
            ],
            "every coefficient is 0, so steps would take no simulated time",
        ),
        (["--capacity", "0.5"], "capacity '0.5' is less than one block of 16 tokens"),
        (["--mode", "replay", "--profile", "llama3.1-8b-h100"], "apply to --mode serve only"),
    ],
)
def test_inconsistent_arguments_are_refused_before_the_trace_is_read(capsys, args, message):
    code, out, err = run_cli(capsys, "simulate", "--trace", "/no/trace.jsonl", *args)
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert line.startswith("pagedkv simulate: error: ") and message in line


# ---------------------------------------------------------------------------- missing extras


@pytest.mark.parametrize(
    ("args", "module", "message"),
    [
        (["--plot", "x.png"], "matplotlib", "--plot needs matplotlib (the [sim] extra)"),
        (
            ["--hash-algorithm", "sha256_cbor"],
            "cbor2",
            "--hash-algorithm sha256_cbor needs cbor2 (the [hashing] extra)",
        ),
        (
            ["--hash-algorithm", "xxh3_128"],
            "xxhash",
            "--hash-algorithm xxh3_128 needs xxhash (the [hashing] extra)",
        ),
        (["--instances", "2"], "zmq", "needs pyzmq (the [events] extra)"),
        (["--metrics-port", "0"], "prometheus_client", "needs prometheus-client (the [metrics]"),
    ],
)
def test_missing_extras_are_named_before_the_run(capsys, monkeypatch, args, module, message):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails
    code, out, err = run_cli(capsys, "simulate", "--trace", "/no/trace.jsonl", *args)
    assert code == 2 and out == ""
    line = one_error_line(err)
    assert message in line and "pip install 'pagedkv[" in line


# ---------------------------------------------------------------------------- memory and limits


@pytest.fixture
def eight_gib(monkeypatch):
    monkeypatch.setattr(memory_guard, "available_memory_bytes", lambda: 8 * GIB)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--capacity", "1G"], "--capacity 1G needs an estimated 260.8 GiB of memory"),
        (
            ["--mode", "replay", "--capacity", "20k,1G,unlimited"],
            "--capacity 20k,1G,unlimited needs an estimated 260.8 GiB of memory",
        ),
        (
            ["--instances", "100", "--capacity", "1M"],  # 100 pools of a million blocks
            "--capacity 1M needs an estimated 26.1 GiB of memory",
        ),
    ],
)
def test_pools_that_cannot_fit_are_refused_with_the_numbers(capsys, eight_gib, args, message):
    code, out, err = run_cli(capsys, "simulate", "--trace", "/no/trace.jsonl", *args)
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        f"pagedkv simulate: error: {message}; this machine has 8.0 GiB available"
    )


def test_a_workload_that_cannot_fit_is_refused_before_generating_it(capsys, eight_gib):
    code, out, err = run_cli(capsys, "simulate", "--workload", "chat", "--num-requests", str(10**9))
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        "pagedkv simulate: error: --workload chat --num-requests 1,000,000,000 needs an "
        "estimated 558.8 GiB of memory; this machine has 8.0 GiB available"
    )


def test_a_replay_prompt_that_cannot_fit_is_refused_from_its_length(capsys, tmp_path, eight_gib):
    trace = tmp_path / "long.jsonl"
    trace.write_text('{"input_length": 2000000000, "output_length": 1}\n')
    code, out, err = run_cli(capsys, "simulate", "--trace", str(trace), "--mode", "replay")
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        "pagedkv simulate: error: replaying request L1 (2,000,000,000 prompt tokens) needs an "
        "estimated 119.2 GiB of memory; this machine has 8.0 GiB available"
    )


def test_a_prompt_longer_than_max_model_len_is_rejected_from_its_length(capsys, tmp_path):
    # Serve mode never builds the 2-billion-token prompt: it is rejected from its length.
    trace = tmp_path / "long.jsonl"
    trace.write_text(
        '{"input_length": 2000000000, "output_length": 1}\n'
        '{"input_length": 100, "output_length": 2, "timestamp": 5}\n'
    )
    code, out, _ = run_cli(capsys, "simulate", "--mode", "serve", "--trace", str(trace), "--json")
    assert code == 0
    results = json.loads(out)["results"]
    assert (results["num_requests_completed"], results["num_requests_rejected"]) == (1, 1)


def test_arrival_times_beyond_exact_float_seconds_are_refused(capsys, tmp_path):
    trace = tmp_path / "late.jsonl"
    trace.write_text('{"input_length": 10, "output_length": 1, "timestamp": 1e12}\n')
    code, out, err = run_cli(
        capsys, "simulate", "--mode", "serve", "--trace", str(trace), "--time-scale", "1000"
    )
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        "pagedkv simulate: error: the last request arrives at 1e+12 s (time scale 1000); "
        "simulated times stay exact up to 1e+10 s: lower --time-scale"
    )


def test_too_many_instances_for_zeromq_is_refused_before_the_run(capsys):
    pytest.importorskip("zmq")
    code, out, err = run_cli(capsys, "simulate", "--trace", "/no/trace.jsonl", "--instances", "600")
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        "pagedkv simulate: error: --instances 600 needs up to 2,400 ZeroMQ sockets; a ZeroMQ "
        "context allows 1,023: simulate at most 255 instances"
    )


def test_too_many_instances_for_the_open_files_limit_names_the_limit():
    pytest.importorskip("zmq")

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))

    result = run_process(
        "simulate", "--trace", TRACE, "--instances", "40", "--event-transport", "tcp",
        preexec=low_limit,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    assert one_error_line(result.stderr) == (
        "pagedkv simulate: error: --instances 40 needs about 384 open files over tcp; this "
        "process may open 128 (ulimit -n): raise the limit or simulate at most 8 instances"
    )


# ---------------------------------------------------------------------------- events listen


def test_events_listen_rejects_a_bad_endpoint(capsys):
    code, out, err = run_cli(capsys, "events", "listen", "notanendpoint")
    assert code == 2 and out == ""
    assert one_error_line(err) == (
        "pagedkv events: error: endpoint 'notanendpoint' is not a ZeroMQ endpoint: expected "
        "tcp://HOST:PORT (e.g. tcp://127.0.0.1:5557), ipc://PATH or inproc://NAME"
    )
    code, _, err = run_cli(capsys, "events", "listen", "tcp://127.0.0.1:1", "--replay", "x:1")
    assert code == 2 and "--replay 'x:1' is not a ZeroMQ endpoint" in one_error_line(err)


def test_events_listen_without_pyzmq_names_the_extra():
    result = run_process(
        "events", "listen", "tcp://127.0.0.1:5557", code_before="sys.modules['zmq'] = None"
    )
    assert result.returncode == 2 and result.stdout == ""
    assert one_error_line(result.stderr) == (
        "pagedkv events: error: pagedkv events listen needs pyzmq (the [events] extra): "
        "pip install 'pagedkv[events]' (in a clone: pip install -e '.[events]')"
    )


# ---------------------------------------------------------------------------- honest reports


def test_a_serve_run_with_no_completed_request_shows_no_latency(capsys):
    # max_model_len 100: every prompt of the trace is longer, so every request is rejected.
    args = ("simulate", "--trace", TRACE, "--capacity", "1000", "--max-model-len", "100")
    code, out, _ = run_cli(capsys, *args, "--json")
    assert code == 0
    results = json.loads(out)["results"]
    assert (results["num_requests_completed"], results["num_requests_rejected"]) == (0, 46)
    assert results["ttft_s"] == {
        "count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None
    }  # fmt: skip
    code, out, _ = run_cli(capsys, *args, "--no-progress")
    ttft_row = next(line for line in out.splitlines() if "TTFT (s)" in line)
    assert ttft_row.count("n/a") == 5 and "0" not in ttft_row


def test_the_cluster_table_shows_rejected_requests(capsys):
    pytest.importorskip("zmq")
    code, out, _ = run_cli(
        capsys, "simulate", "--trace", TRACE, "--instances", "2", "--router", "round-robin",
        "--capacity", "1000", "--max-model-len", "100",
    )  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("router"))
    row = next(line for line in lines if line.startswith("round-robin "))
    assert header.split()[:2] == ["router", "completed"]
    assert row.split()[:6] == ["round-robin", "0", "0.00%", "n/a", "n/a", "n/a"]
    assert "round-robin: 46 requests rejected (prompt >= max_model_len 100)" in lines


# ---------------------------------------------------------------------------- Ctrl-C


def interrupt_when_running(*args: str) -> tuple[int, str, str]:
    """Run `pagedkv simulate ARGS` with stderr on a terminal, press Ctrl-C once its progress
    bar shows (the run is under way), and return (exit code, stdout, terminal output)."""
    master, slave = pty.openpty()
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedkv", "simulate", *args],
        stdout=subprocess.PIPE,
        stderr=slave,
        stdin=subprocess.DEVNULL,
        env=dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="200"),
    )
    os.close(slave)
    terminal = b""
    try:
        deadline = time.monotonic() + 120
        while not terminal and time.monotonic() < deadline:
            if select.select([master], [], [], 0.2)[0]:
                terminal += os.read(master, 65536)
        assert terminal, "no progress bar within 120 s"
        process.send_signal(signal.SIGINT)
        out, _ = process.communicate(timeout=120)
        while select.select([master], [], [], 0.2)[0]:
            try:
                terminal += os.read(master, 65536)
            except OSError:  # the terminal closed with the process
                break
    finally:
        if process.poll() is None:
            process.kill()
        os.close(master)
    return process.returncode, out.decode(), terminal.decode(errors="replace")


# Far more work than a test waits for: 20,000 chat requests, 91 M prompt tokens.
LONG_RUN = ("--workload", "chat", "--num-requests", "20000", "--rate", "20", "--capacity", "20000")


def test_ctrl_c_during_serve_reports_what_was_measured():
    code, out, terminal = interrupt_when_running(*LONG_RUN)
    assert code == 130
    assert "Traceback" not in terminal
    assert "stopping: the report covers what was measured so far" in terminal
    lines = out.splitlines()
    assert lines[0].endswith("(INTERRUPTED)")
    note = next(line for line in lines if line.startswith("INTERRUPTED"))
    unfinished = int(note.split("with ")[1].split(" requests")[0].replace(",", ""))
    completed = int(
        next(line for line in lines if line.startswith("requests")).split()[1].replace(",", "")
    )
    assert 0 < unfinished <= 20_000 and completed + unfinished == 20_000


def test_ctrl_c_during_a_cluster_run_reports_what_was_measured():
    pytest.importorskip("zmq")
    code, out, terminal = interrupt_when_running(*LONG_RUN, "--instances", "2", "--router", "all")
    assert code == 130
    assert "Traceback" not in terminal
    lines = out.splitlines()
    routers = ("round-robin", "least-loaded", "prefix-aware")
    rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in routers]
    assert [row[0] for row in rows] == ["round-robin"]  # the routers after it did not run
    completed = int(rows[0][1].replace(",", ""))
    note = next(line for line in lines if line.startswith("round-robin: INTERRUPTED"))
    unfinished = int(note.split("with ")[1].split(" requests")[0].replace(",", ""))
    assert 0 < unfinished <= 20_000 and completed + unfinished == 20_000
    assert "router index equals every instance's cache at the end: yes" in lines
