"""Leaf: reading untrusted input within a byte budget, whatever the file is: a regular file, a
FIFO or pipe, a device (/dev/zero never ends), a terminal or stdin.

A file's size says nothing about a stream, so the budget is counted while reading: no line, and
no whole input, is ever held beyond its budget plus one read. Standard library only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import BinaryIO

from pagedkv.errors import InvalidArgumentError
from pagedkv.memory_guard import format_bytes

# One read: large enough that a regular file goes at disk speed, small beside any budget.
READ_CHUNK_BYTES = 1 << 20


class InputTooLargeError(InvalidArgumentError):
    """An input, or one line of it, is longer than its budget (nothing past the budget plus one
    read was kept). `line_number` is the 1-based line for a line budget, None for a whole
    input; `max_bytes` is the budget."""

    def __init__(self, message: str, max_bytes: int, line_number: int | None = None) -> None:
        super().__init__(message)
        self.max_bytes = max_bytes
        self.line_number = line_number


class LineTooLongError(InputTooLargeError):
    """One line of an input is longer than its budget (`line_number` is that line)."""


def read_at_most(path: str | os.PathLike[str], max_bytes: int, what: str = "the file") -> bytes:
    """All of `path`'s bytes, or `InputTooLargeError` once there are more than `max_bytes`.

    `what` names the input in the message (`"a config.json"`). Errors opening or reading are
    the `OSError` of `open` (a directory: `IsADirectoryError`).
    """
    pieces: list[bytes] = []
    num_bytes = 0
    with open(path, "rb") as file:
        read = file.read1
        while True:
            chunk = read(min(READ_CHUNK_BYTES, max_bytes + 1 - num_bytes))
            if not chunk:
                return b"".join(pieces)
            num_bytes += len(chunk)
            if num_bytes > max_bytes:
                raise InputTooLargeError(
                    f"{os.fspath(path)}: more than {format_bytes(max_bytes)}, too long for {what}",
                    max_bytes,
                )
            pieces.append(chunk)


def iter_lines(file: BinaryIO, max_line_bytes: int, name: str) -> Iterator[tuple[int, bytes]]:
    """`(line_number, line)` for each line of a binary stream that is not blank (whitespace
    only), without its `\n`; 1-based numbers count every line.

    Raises `LineTooLongError` (naming `name` and the line) as soon as a line passes
    `max_line_bytes`, having held at most `max_line_bytes + READ_CHUNK_BYTES` of it, and
    `InputTooLargeError` when a run of blank lines does (an endless stream of newlines would
    otherwise be read for ever, at no memory cost but all of the time). A final line without
    a newline is yielded too.
    """
    read = getattr(file, "read1", file.read)
    pending: list[bytes] = []  # the pieces of a line that continues into the next read
    num_pending = 0
    line_number = 0
    num_blank_bytes = 0  # of the blank lines since the last line yielded
    while True:
        chunk = read(READ_CHUNK_BYTES)
        if not chunk:
            break
        if not pending and chunk.isspace():
            # Hot path: a read of blank lines only, skipped at C speed.
            line_number += chunk.count(b"\n")
            tail_start = chunk.rfind(b"\n") + 1  # a blank start of the next line follows
            num_blank_bytes += tail_start
            if num_blank_bytes > max_line_bytes:
                raise _blank_too_long(name, line_number, max_line_bytes)
            if tail_start < len(chunk):
                pending.append(chunk[tail_start:])
                num_pending = len(chunk) - tail_start
            continue
        pieces = chunk.split(b"\n")
        last = pieces.pop()  # the start of a line the next read continues ("" after a newline)
        for piece in pieces:
            line_number += 1
            if pending:
                num_pending += len(piece)
                if num_pending > max_line_bytes:
                    raise _line_too_long(name, line_number, max_line_bytes)
                pending.append(piece)
                piece = b"".join(pending)
                pending.clear()
                num_pending = 0
            elif len(piece) > max_line_bytes:
                raise _line_too_long(name, line_number, max_line_bytes)
            if not piece or piece.isspace():
                num_blank_bytes += len(piece) + 1
                if num_blank_bytes > max_line_bytes:
                    raise _blank_too_long(name, line_number, max_line_bytes)
                continue
            num_blank_bytes = 0
            yield line_number, piece
        if last:
            num_pending += len(last)
            if num_pending > max_line_bytes:
                raise _line_too_long(name, line_number + 1, max_line_bytes)
            pending.append(last)
    if pending:
        line = b"".join(pending)
        if not line.isspace():
            yield line_number + 1, line


def _blank_too_long(name: str, line_number: int, max_line_bytes: int) -> InputTooLargeError:
    return InputTooLargeError(
        f"{name}:{line_number}: more than {format_bytes(max_line_bytes)} of blank lines in a row",
        max_line_bytes,
        line_number,
    )


def _line_too_long(name: str, line_number: int, max_line_bytes: int) -> LineTooLongError:
    return LineTooLongError(
        f"{name}:{line_number}: the line is longer than {format_bytes(max_line_bytes)}",
        max_line_bytes,
        line_number,
    )
