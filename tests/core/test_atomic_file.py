"""Output files appear whole or not at all (`pagedkv.atomic_file`), with concurrent writers."""

from __future__ import annotations

import multiprocessing
import os
import stat
import time
from pathlib import Path

import pytest

from pagedkv.atomic_file import atomic_write

NUM_WRITERS = 6
NUM_CHUNKS = 32
CHUNK_BYTES = 32 * 1024


def payload(writer: int) -> bytes:
    """What writer `writer` writes: distinct per writer and per chunk."""
    return b"".join(
        bytes([writer]) * 8 + chunk.to_bytes(4, "little") + bytes([writer]) * (CHUNK_BYTES - 12)
        for chunk in range(NUM_CHUNKS)
    )


def write_slowly(path: str, writer: int, start_at: float) -> None:
    time.sleep(max(0.0, start_at - time.monotonic()))  # everyone starts together
    data = payload(writer)
    with atomic_write(path) as file:
        for offset in range(0, len(data), CHUNK_BYTES):
            file.write(data[offset : offset + CHUNK_BYTES])
            file.flush()  # the bytes reach the file while the others write theirs
            time.sleep(0.001)


def test_concurrent_writers_leave_exactly_one_writers_bytes(tmp_path):
    path = tmp_path / "plot.png"
    path.write_bytes(b"an older plot")
    expected = {payload(writer) for writer in range(NUM_WRITERS)}
    context = multiprocessing.get_context("fork")
    for _ in range(4):
        start_at = time.monotonic() + 0.2
        processes = [
            context.Process(target=write_slowly, args=(str(path), writer, start_at))
            for writer in range(NUM_WRITERS)
        ]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
            assert process.exitcode == 0
        assert path.read_bytes() in expected
        assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]  # no temporary left


def test_an_error_mid_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk on fire"):
        with atomic_write(path) as file:
            file.write(b"half of the new")
            raise RuntimeError("disk on fire")
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_a_new_file_gets_the_umask_mode_and_an_old_one_keeps_its_mode(tmp_path):
    umask = os.umask(0o022)
    try:
        new = tmp_path / "new.svg"
        with atomic_write(new) as file:
            file.write(b"<svg/>")
        assert stat.S_IMODE(new.stat().st_mode) == 0o644
        old = tmp_path / "old.svg"
        old.write_bytes(b"x")
        old.chmod(0o600)
        with atomic_write(old) as file:
            file.write(b"<svg/>")
        assert stat.S_IMODE(old.stat().st_mode) == 0o600
        assert old.read_bytes() == b"<svg/>"
    finally:
        os.umask(umask)


def test_a_symlink_is_followed(tmp_path):
    target = tmp_path / "real.png"
    target.write_bytes(b"old")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    with atomic_write(link) as file:
        file.write(b"new")
    assert link.is_symlink()
    assert target.read_bytes() == b"new"


def test_a_device_is_written_in_place_not_replaced():
    devnull = Path(os.devnull)
    before = devnull.stat()
    with atomic_write(devnull) as file:
        file.write(b"gone")
    after = devnull.stat()
    assert stat.S_ISCHR(after.st_mode)
    assert (after.st_ino, after.st_rdev) == (before.st_ino, before.st_rdev)


def test_a_full_device_raises_the_os_error():
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    with pytest.raises(OSError, match="No space left"):
        with atomic_write("/dev/full") as file:
            file.write(b"x" * 100_000)
