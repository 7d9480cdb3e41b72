"""A reader that goes away (`pagedkv ... | head`) ends every command the same way: quietly, exit
141 (128 + SIGPIPE, the shell's code for a writer killed by it). Made deterministic: stdout is
a pipe whose reading end is closed before the command writes anything."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.paths import DATA_DIR, SRC_DIR

SRC = SRC_DIR
TRACE = str(DATA_DIR / "mooncake_conversations46.jsonl")

CLUSTER = ("--instances", "2", "--router", "round-robin")
COMMANDS = {
    "--help": ["--help"],
    "--version": ["--version"],
    "simulate --help": ["simulate", "--help"],
    "simulate --list-profiles": ["simulate", "--list-profiles"],
    "simulate (serve table)": ["simulate", "--mode", "serve", "--trace", TRACE],
    "simulate --json": ["simulate", "--mode", "serve", "--trace", TRACE, "--json"],
    "simulate --mode replay (table)": ["simulate", "--mode", "replay", "--trace", TRACE],
    "simulate --instances 2": ["simulate", "--trace", TRACE, *CLUSTER],
    "size": ["size", "--config", "llama-3.1-8b", "--memory", "80GiB"],
    "size --json": ["size", "--config", "llama-3.1-8b", "--memory", "80GiB", "--json"],
    "events --help": ["events", "--help"],
    "router --help": ["router", "--help"],
    "generate --help": ["generate", "--help"],
}


@pytest.mark.parametrize("args", COMMANDS.values(), ids=COMMANDS.keys())
def test_a_closed_pipe_ends_every_command_quietly_with_141(args):
    if "--instances" in args:
        pytest.importorskip("zmq")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first write
    try:
        result = subprocess.run(
            [sys.executable, "-m", "pagedkv", *args],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=str(SRC)),
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert result.returncode == 141, result.stderr
    assert result.stderr == ""
