"""Leaf: output files that appear whole or not at all (`--plot` and any other file a command
writes), even with several writers of one path at once.

Standard library only; knows nothing of what is written.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

_MAX_NAME_TRIES = 100


@contextmanager
def atomic_write(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """A binary file that becomes `path` only when the `with` block ends without an error.

    It is a temporary file in `path`'s folder (`.NAME.RANDOM.tmp`), flushed and fsync'ed, then
    renamed over `path`: a reader, or another writer of the same path, sees the old file or one
    whole new one, never a mix. An error (or Ctrl-C) removes the temporary file and leaves
    `path` as it was. An existing file keeps its permission bits; a new one gets the default
    (0o666 less the umask, as `open` would). A symlink is followed (its target is replaced).
    A `path` that exists and is no regular file (a device such as /dev/null or /dev/stdout, a
    FIFO) is written in place: there is no file to replace, and renaming over a device node
    would destroy it.
    """
    target = os.path.realpath(os.fspath(path))
    try:
        existing = os.stat(target)
    except FileNotFoundError:
        existing = None
    if existing is not None and not stat.S_ISREG(existing.st_mode):
        with open(target, "wb") as file:
            yield file
        return
    directory = os.path.dirname(target)
    temporary, fd = _create_temporary(directory, os.path.basename(target))
    try:
        if existing is not None:
            os.fchmod(fd, stat.S_IMODE(existing.st_mode))
        with os.fdopen(fd, "wb") as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, target)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
    _fsync_directory(directory)


def _create_temporary(directory: str, name: str) -> tuple[str, int]:
    """A new file next to the target, opened for writing (the umask applies to its mode)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    for _ in range(_MAX_NAME_TRIES):
        temporary = os.path.join(directory, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return temporary, os.open(temporary, flags, 0o666)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name next to {os.path.join(directory, name)}")


def _fsync_directory(directory: str) -> None:
    """Make the rename itself durable (best effort: not every file system can)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
