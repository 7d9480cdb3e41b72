"""`pagedkv.sim.results`: a report as rows (one per cell and metric), Parquet and CSV files
with the command line and version, written atomically."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

from pagedkv import __version__
from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.replay import replay
from pagedkv.sim.report import replay_report
from pagedkv.sim.report.results import (
    COLUMNS,
    META_SUFFIX,
    output_format,
    report_rows,
    write_results,
)
from tests.support.paths import DATA_DIR

COMMAND = ["pagedkv", "simulate", "--mode", "replay", "--capacity", "100,unlimited"]


@pytest.fixture(scope="module")
def replay_report_40():
    trace = load_trace(DATA_DIR / "mooncake_head40.jsonl")
    points = replay(trace, [100, None], 16)
    return replay_report(trace, points, 16, "sha256")


def test_replay_rows_one_per_capacity_and_metric(replay_report_40):
    rows = report_rows(replay_report_40)
    head = ("replay", "mooncake_head40.jsonl", 16, None, "lru")
    unlimited = replay_report_40["results"][1]
    assert unlimited["capacity_blocks"] is None and unlimited["num_hit_tokens"] > 1536
    assert rows == [
        (*head, 100, None, 0, "hit_rate", 0.00303389),
        (*head, 100, None, 0, "num_hit_tokens", 1536.0),
        (*head, 100, None, 0, "num_prompt_tokens", 506280.0),
        (*head, 100, None, 0, "num_requests_not_fit", 36.0),
        (*head, None, None, 1, "hit_rate", unlimited["hit_rate"]),
        (*head, None, None, 1, "num_hit_tokens", float(unlimited["num_hit_tokens"])),
        (*head, None, None, 1, "num_prompt_tokens", 506280.0),
        (*head, None, None, 1, "num_requests_not_fit", 0.0),
    ]


def test_serve_rows_flatten_nested_results_and_drop_lists():
    report = {
        "mode": "serve",
        "trace": {"name": "t"},
        "config": {"block_size": 16, "profile": "p", "num_blocks": 500},
        "results": {
            "ttft_s": {"p50": 0.5, "p90": None},
            "interrupted": True,
            "timeline": {"usage": [0.1, 0.2]},
            "note": "text",
        },
    }
    assert report_rows(report) == [
        ("serve", "t", 16, "p", "lru", 500, None, 0, "interrupted", 1.0),
        ("serve", "t", 16, "p", "lru", 500, None, 0, "ttft_s.p50", 0.5),
        ("serve", "t", 16, "p", "lru", 500, None, 0, "ttft_s.p90", None),
    ]


def test_csv_file_and_its_sidecar(replay_report_40, tmp_path):
    path = tmp_path / "results.csv"
    assert write_results(str(path), replay_report_40, COMMAND) == 8
    with path.open(newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == list(COLUMNS)
    head = ["replay", "mooncake_head40.jsonl", "16", "", "lru"]
    assert rows[1] == [*head, "100", "", "0", "hit_rate", "0.00303389"]
    assert len(rows) == 9
    assert rows[5][5] == "" and rows[5][8] == "hit_rate"  # unlimited: an empty capacity
    meta = json.loads(Path(str(path) + META_SUFFIX).read_text())
    assert meta["pagedkv.command"] == "pagedkv simulate --mode replay --capacity 100,unlimited"
    assert meta["pagedkv.version"] == __version__
    assert meta["pagedkv.mode"] == "replay" and meta["num_rows"] == 8
    assert json.loads(meta["pagedkv.config"]) == replay_report_40["config"]
    assert sorted(os.listdir(tmp_path)) == ["results.csv", "results.csv" + META_SUFFIX]


def test_parquet_file_with_metadata(replay_report_40, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "results.parquet"
    path.write_bytes(b"an older file")  # replaced whole
    assert write_results(str(path), replay_report_40, COMMAND) == 8
    table = pq.read_table(path)
    assert table.column_names == list(COLUMNS)
    assert [tuple(row.values()) for row in table.to_pylist()] == report_rows(replay_report_40)
    meta = {key.decode(): value.decode() for key, value in table.schema.metadata.items()}
    assert meta["pagedkv.command"] == "pagedkv simulate --mode replay --capacity 100,unlimited"
    assert meta["pagedkv.version"] == __version__
    assert sorted(os.listdir(tmp_path)) == ["results.parquet"]  # no temporary file left


def test_a_failed_write_leaves_the_old_file_and_no_temporary(
    replay_report_40, tmp_path, monkeypatch
):
    path = tmp_path / "results.csv"
    path.write_text("old")

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        write_results(str(path), replay_report_40, COMMAND)
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["results.csv"]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("results.xlsx", "the extension picks the format: .parquet or .csv"),
        ("missing/results.csv", "does not exist"),
    ],
)
def test_bad_output_paths_are_refused(tmp_path, name, message):
    with pytest.raises(InvalidArgumentError, match=message):
        output_format(str(tmp_path / name))


def test_a_folder_is_refused(tmp_path):
    (tmp_path / "out.csv").mkdir()
    with pytest.raises(InvalidArgumentError, match="is a folder"):
        output_format(str(tmp_path / "out.csv"))
