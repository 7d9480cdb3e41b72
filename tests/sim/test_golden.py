"""Golden JSON reports of `pagedkv simulate` on a small real trace.

`tests/data/mooncake_conversations46.jsonl` holds 46 lines of the Mooncake conversation trace
(five-request groups sharing a second block, from its first 3,000 lines). The goldens pin the
whole pipeline: loader, token mapping, hashing, manager, scheduler, cost model and report.

Regenerate only on purpose (a deliberate change of behaviour, reviewed in the diff), never to
make a failing test pass:

    PAGEDKV_REGEN_GOLDEN=1 PYTHONPATH=src python -m pytest tests/sim/test_golden.py
"""

from __future__ import annotations

import os

import pytest

from pagedkv.cli import main
from tests.support.paths import DATA_DIR

DATA = DATA_DIR
TRACE = DATA / "mooncake_conversations46.jsonl"
CASES = {
    "golden_serve.json": ["--capacity", "3000", "--time-scale", "0.05"],
    "golden_replay.json": ["--mode", "replay", "--capacity", "500,2000,8000,unlimited"],
}


@pytest.mark.parametrize("golden", sorted(CASES))
def test_report_matches_golden(golden, capsys):
    assert main(["simulate", "--trace", str(TRACE), "--json", *CASES[golden]]) == 0
    produced = capsys.readouterr().out
    path = DATA / golden
    if os.environ.get("PAGEDKV_REGEN_GOLDEN") == "1":
        path.write_text(produced)
    assert produced == path.read_text()
