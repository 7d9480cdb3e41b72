"""Test helper: a local Ray whose workers can import the test modules (their jobs)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from tests.support.paths import REPO_DIR


@contextmanager
def ray_workers_import_tests() -> Iterator[None]:
    """While Ray starts: its workers inherit PYTHONPATH, so put the repository root on it
    (pytest put it on this process's sys.path only): jobs defined in a test module
    (`tests.sim.test_executors.pick`) are found by name."""
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_DIR), previous]))
    try:
        yield
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
