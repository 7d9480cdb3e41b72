"""Where the suite's files are, for tests in any folder (not a test module)."""

from __future__ import annotations

from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parents[1]
DATA_DIR = TESTS_DIR / "data"  # traces and golden outputs
REPO_DIR = TESTS_DIR.parent
SRC_DIR = REPO_DIR / "src"  # the pagedkv tree under test, for subprocesses' PYTHONPATH
