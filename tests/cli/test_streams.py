"""Inputs that are not regular files are bounded like files: `--trace` and `size --config` from
/dev/zero, from FIFOs fed for ever by a writer thread, from directories. One clear line, exit 2,
memory bounded (each run under a 2 GiB address-space limit), and quickly."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from tests.support.paths import DATA_DIR as DATA
from tests.support.paths import SRC_DIR as SRC

ADDRESS_SPACE_BYTES = 2 * 2**30


def limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def pagedkv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(SRC)),
        preexec_fn=limit_memory,
        timeout=120,
    )


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def fifo_fed(tmp_path: Path, chunk: bytes, *, forever: bool = True) -> tuple[Path, threading.Event]:
    """A FIFO a writer thread fills with `chunk` (for ever, or once) until the reader is gone."""
    path = tmp_path / "stream"
    os.mkfifo(path)
    stop = threading.Event()

    def feed() -> None:
        try:
            with open(path, "wb") as fifo:
                fifo.write(chunk)
                while forever and not stop.is_set():
                    fifo.write(chunk)
        except BrokenPipeError:  # the reader refused the input and closed it
            pass

    threading.Thread(target=feed, daemon=True, name="fifo-writer").start()
    return path, stop


def test_a_trace_from_dev_zero_is_one_endless_line():
    line = one_error_line(pagedkv("simulate", "--trace", "/dev/zero", "--no-progress"))
    assert line.startswith("pagedkv simulate: error: /dev/zero:1: the line is longer than ")
    assert "of memory this machine has available" in line


@pytest.mark.parametrize(
    ("chunk", "message"),
    [
        (b"7" * 65536, "stream:1: the line is longer than "),
        (b"\n" * 65536, ": more than "),  # endless blank lines: no memory, all the time
    ],
    ids=["endless line", "endless blank lines"],
)
def test_a_trace_from_an_endless_fifo_is_refused(tmp_path, chunk, message):
    path, stop = fifo_fed(tmp_path, chunk)
    try:
        line = one_error_line(pagedkv("simulate", "--trace", str(path), "--no-progress"))
    finally:
        stop.set()
    assert line.startswith("pagedkv simulate: error: ") and message in line
    if chunk.startswith(b"\n"):
        assert line.endswith("of blank lines in a row")


def test_a_finite_trace_from_a_fifo_still_runs(tmp_path):
    trace = (DATA / "mooncake_head40.jsonl").read_bytes()
    path, _ = fifo_fed(tmp_path, trace, forever=False)
    result = pagedkv("simulate", "--mode", "replay", "--trace", str(path), "--json",
                     "--capacity", "100000")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert '"num_requests": 40' in result.stdout


def test_size_config_from_dev_zero_a_fifo_and_directories(tmp_path):
    line = one_error_line(pagedkv("size", "--config", "/dev/zero", "--memory", "1GiB"))
    assert line == "pagedkv size: error: /dev/zero: more than 16.0 MiB, too long for a config.json"
    (tmp_path / "empty").mkdir()
    line = one_error_line(pagedkv("size", "--config", str(tmp_path / "empty"), "--memory", "1GiB"))
    assert (
        line == f"pagedkv size: error: {tmp_path / 'empty'}: a directory without a config.json file"
    )
    config = (SRC / "pagedkv" / "data" / "configs" / "llama-3.1-8b.json").read_bytes()
    path, _ = fifo_fed(tmp_path, config, forever=False)
    result = pagedkv("size", "--config", str(path), "--memory", "80GiB", "--json")
    assert result.returncode == 0, result.stderr
    assert '"num_blocks"' in result.stdout


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ('{"a": ' * 100_000 + "1" + "}" * 100_000, "maximum recursion depth exceeded"),
        ('{"num_hidden_layers": ' + "9" * 5000 + "}", "Exceeds the limit (4300 digits)"),
    ],
    ids=["100,000 nested objects", "a 5,000-digit int"],
)
def test_size_config_that_json_cannot_take(tmp_path, text, problem):
    path = tmp_path / "config.json"
    path.write_text(text)
    line = one_error_line(pagedkv("size", "--config", str(path), "--memory", "1GiB"))
    assert line.startswith(f"pagedkv size: error: {path}: not usable JSON (")
    assert problem in line and "set_int_max_str_digits" not in line
