"""One shutdown path for SIGINT, SIGTERM and SIGHUP, sent to the process group of a real
`pagedkv simulate` (as a terminal, a service manager or `kill -- -PGID` does) or to its pid
alone: the partial report Ctrl-C gives, worker processes ended, Redis namespaces dropped, exit
128 + the signal."""

from __future__ import annotations

import os
import pty
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.paths import SRC_DIR as SRC
from tests.support.redis_server import import_redis, redis_server  # noqa: F401 - fixture

# Far more work than a test waits for: 20,000 chat requests.
LONG_SERVE = ("--mode", "serve", "--workload", "chat", "--num-requests", "20000", "--rate", "20")
LONG_REPLAY = ("--mode", "replay", "--workload", "chat", "--num-requests", "20000", "--jobs", "2")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def processes_in_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def wait_until(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s"
        time.sleep(0.05)


class Run:
    """`pagedkv simulate ARGS` in its own session and process group, stderr on a terminal
    (so the progress bar shows once the run is under way)."""

    def __init__(self, *args: str) -> None:
        self.master, slave = pty.openpty()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", "simulate", *args],
            stdout=subprocess.PIPE,
            stderr=slave,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=str(SRC), COLUMNS="200"),
            start_new_session=True,
        )
        os.close(slave)
        self.pgid = self.process.pid
        self.terminal = b""

    def wait_for_progress(self) -> None:
        deadline = time.monotonic() + 120
        while not self.terminal and time.monotonic() < deadline:
            if select.select([self.master], [], [], 0.2)[0]:
                self.terminal += os.read(self.master, 65536)
        assert self.terminal, "no progress bar within 120 s"

    def finish(self) -> tuple[int, str, str]:
        """Wait for the end; (exit code, stdout, terminal)."""
        try:
            out, _ = self.process.communicate(timeout=120)
            while select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.terminal += os.read(self.master, 65536)
                except OSError:  # the terminal closed with the process
                    break
        finally:
            self.close()
        return self.process.returncode, out.decode(), self.terminal.decode(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.pgid, signal.SIGKILL)
            self.process.wait()
        os.close(self.master)


def counts(report: str) -> tuple[int, int]:
    """(completed, unfinished) requests of an interrupted serve report."""
    lines = report.splitlines()
    note = next(line for line in lines if line.startswith("INTERRUPTED"))
    unfinished = int(note.split("with ")[1].split(" requests")[0].replace(",", ""))
    completed = next(line for line in lines if line.startswith("requests")).split()[1]
    return int(completed.replace(",", "")), unfinished


@pytest.mark.parametrize("signum", SIGNALS, ids=lambda s: s.name)
def test_serve_stopped_by_any_signal_to_its_group_reports_what_was_measured(signum):
    run = Run(*LONG_SERVE)
    run.wait_for_progress()
    os.killpg(run.pgid, signum)
    code, out, terminal = run.finish()
    assert code == 128 + signum
    assert "Traceback" not in terminal
    again = "Ctrl-C" if signum == signal.SIGINT else signum.name
    assert f"stopping: the report covers what was measured so far ({again} again" in terminal
    assert out.splitlines()[0].endswith("(INTERRUPTED)")
    completed, unfinished = counts(out)
    assert 0 < unfinished <= 20_000 and completed + unfinished == 20_000
    assert processes_in_group(run.pgid) == []


@pytest.mark.parametrize(
    ("signum", "target"),
    [(signal.SIGTERM, "group"), (signal.SIGHUP, "group"), (signal.SIGTERM, "pid")],
    ids=["SIGTERM-group", "SIGHUP-group", "SIGTERM-pid-only"],
)
def test_a_parallel_replay_ends_its_workers_on_any_signal(signum, target):
    run = Run(*LONG_REPLAY)
    run.wait_for_progress()
    workers = [pid for pid in processes_in_group(run.pgid) if pid != run.process.pid]
    assert len(workers) == 2
    if target == "group":
        os.killpg(run.pgid, signum)
    else:  # the workers get nothing: the parent must end them
        os.kill(run.process.pid, signum)
    code, out, terminal = run.finish()
    assert code == 128 + signum, terminal
    assert terminal.strip().splitlines()[-1] == f"pagedkv simulate: interrupted ({signum.name})"
    assert "Traceback" not in terminal and out == ""
    assert processes_in_group(run.pgid) == []


def test_workers_die_with_a_killed_parent():
    run = Run(*LONG_REPLAY)
    try:
        run.wait_for_progress()
        workers = [pid for pid in processes_in_group(run.pgid) if pid != run.process.pid]
        assert len(workers) == 2
        run.process.kill()  # SIGKILL: no clean-up of ours runs; the kernel ends the workers
        run.process.wait()
        wait_until(lambda: processes_in_group(run.pgid) == [], "workers left after SIGKILL")
    finally:
        run.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_cluster_run_stopped_by_a_signal_drops_its_redis_namespace(signum, redis_server):  # noqa: F811
    pytest.importorskip("zmq")
    client = import_redis().Redis.from_url(redis_server.url)
    client.flushall()
    run = Run(*LONG_SERVE, "--instances", "2", "--router", "prefix-aware",
              "--index", redis_server.url)  # fmt: skip
    run.wait_for_progress()
    wait_until(lambda: client.dbsize() > 0, "the run's index in Redis")
    os.killpg(run.pgid, signum)
    code, out, terminal = run.finish()
    assert code == 128 + signum
    assert "Traceback" not in terminal
    assert any(line.startswith("prefix-aware: INTERRUPTED") for line in out.splitlines())
    assert "router index equals every instance's cache at the end: yes" in out
    assert client.dbsize() == 0
    assert processes_in_group(run.pgid) == []
