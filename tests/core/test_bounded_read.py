"""Byte budgets that hold whatever the input is (`pagedkv.bounded_read`): regular files, FIFOs
fed by a writer thread, /dev/zero."""

from __future__ import annotations

import io
import os
import threading
import tracemalloc
from pathlib import Path

import pytest

from pagedkv.bounded_read import (
    READ_CHUNK_BYTES,
    InputTooLargeError,
    LineTooLongError,
    iter_lines,
    read_at_most,
)
from pagedkv.errors import InvalidArgumentError


def test_lines_come_back_whole_across_reads_numbered_blank_ones_skipped():
    lines = [b"x" * n for n in (1, READ_CHUNK_BYTES - 1, READ_CHUNK_BYTES, 3 * READ_CHUNK_BYTES)]
    data = b"\n".join(lines) + b"\n\n  \t\r\n" + b"\n" * READ_CHUNK_BYTES + b"last, no newline"
    got = list(iter_lines(io.BufferedReader(io.BytesIO(data)), 4 * READ_CHUNK_BYTES, "t"))
    last_number = len(lines) + 2 + READ_CHUNK_BYTES + 1
    assert got == [*enumerate(lines, start=1), (last_number, b"last, no newline")]


def test_a_line_past_the_budget_is_refused_naming_its_line():
    data = b"short\n" + b"y" * 5000 + b"\nnever read\n"
    with pytest.raises(LineTooLongError) as caught:
        list(iter_lines(io.BytesIO(data), 4096, "trace.jsonl"))
    assert caught.value.line_number == 2
    assert caught.value.max_bytes == 4096
    assert str(caught.value) == "trace.jsonl:2: the line is longer than 4.0 KiB"
    assert isinstance(caught.value, InvalidArgumentError)


def test_a_line_exactly_at_the_budget_is_accepted():
    assert list(iter_lines(io.BytesIO(b"z" * 4096 + b"\n"), 4096, "t")) == [(1, b"z" * 4096)]


@pytest.mark.parametrize("blank", [b"\n", b" \r\n"], ids=["newlines", "spaces and CRLF"])
def test_a_run_of_blank_lines_past_the_budget_is_refused(blank):
    data = b"{}\n" + blank * (3 * READ_CHUNK_BYTES // len(blank)) + b"{}\n"
    lines = iter_lines(io.BytesIO(data), READ_CHUNK_BYTES, "t")
    assert next(lines) == (1, b"{}")
    with pytest.raises(InputTooLargeError, match="more than 1.0 MiB of blank lines in a row") as e:
        next(lines)
    assert not isinstance(e.value, LineTooLongError)
    # Blank lines between lines are fine, however many in all.
    data = (b"{}\n" + blank * (READ_CHUNK_BYTES // 2 // len(blank))) * 8
    assert len(list(iter_lines(io.BytesIO(data), READ_CHUNK_BYTES, "t"))) == 8


def fifo_fed_forever(tmp_path: Path, chunk: bytes) -> tuple[Path, threading.Event]:
    """A FIFO a writer thread fills with `chunk` until the reader goes away (or `stop`)."""
    path = tmp_path / "fifo"
    os.mkfifo(path)
    stop = threading.Event()

    def feed() -> None:
        try:
            with open(path, "wb") as fifo:
                while not stop.is_set():
                    fifo.write(chunk)
        except BrokenPipeError:  # the reader refused the input and closed it
            pass

    threading.Thread(target=feed, daemon=True, name="fifo-writer").start()
    return path, stop


def test_an_endless_line_from_a_fifo_is_refused_with_bounded_memory(tmp_path):
    path, stop = fifo_fed_forever(tmp_path, b"1" * 65536)  # digits, never a newline
    max_line_bytes = 8 * READ_CHUNK_BYTES
    tracemalloc.start()
    try:
        with open(path, "rb") as file, pytest.raises(LineTooLongError) as caught:
            for _ in iter_lines(file, max_line_bytes, str(path)):
                pass
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        stop.set()
    assert caught.value.line_number == 1
    assert peak_bytes < max_line_bytes + 3 * READ_CHUNK_BYTES


def test_dev_zero_is_refused_as_one_endless_line():
    with open("/dev/zero", "rb") as file, pytest.raises(LineTooLongError, match=":1: the line"):
        for _ in iter_lines(file, 4 * READ_CHUNK_BYTES, "/dev/zero"):
            pass


def test_read_at_most_reads_a_small_file_and_refuses_more(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"{}" * 100)
    assert read_at_most(path, 200) == b"{}" * 100
    with pytest.raises(InputTooLargeError, match="more than 199 bytes, too long for a config"):
        read_at_most(path, 199, "a config")


def test_read_at_most_stops_an_endless_stream(tmp_path):
    with pytest.raises(InputTooLargeError, match="/dev/zero: more than 1.0 MiB"):
        read_at_most("/dev/zero", READ_CHUNK_BYTES)
    path, stop = fifo_fed_forever(tmp_path, b"{" * 4096)
    try:
        with pytest.raises(InputTooLargeError):
            read_at_most(path, 3 * READ_CHUNK_BYTES)
    finally:
        stop.set()


def test_read_at_most_of_a_directory_is_the_os_error(tmp_path):
    with pytest.raises(IsADirectoryError):
        read_at_most(tmp_path, 100)
