"""`pagedkv simulate` sweeps: comma lists and TOML grids, `--executor ray` byte for byte the same
JSON as `--jobs 1`, `--output` files, and the refusals (one line, exit 2)."""

from __future__ import annotations

import csv
import json
from importlib.util import find_spec

import pytest

from pagedkv.cli import main
from tests.support.paths import DATA_DIR

TRACE = str(DATA_DIR / "mooncake_head40.jsonl")
GRID = ["--mode", "replay", "--trace", TRACE, "--block-size", "16,64"]
GRID += ["--eviction", "lru,s3fifo", "--capacity", "200,1000"]


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["simulate", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_sweep_lists_every_cell_in_grid_order(capsys):
    code, out, _ = run_cli(capsys, *GRID, "--jobs", "1", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["mode"] == "sweep" and report["sweep_mode"] == "replay"
    cells = [(c["block_size"], c["policy"], c["capacity_blocks"]) for c in report["cells"]]
    assert cells == [
        (16, "lru", 200),
        (16, "lru", 1000),
        (16, "s3fifo", 200),
        (16, "s3fifo", 1000),
        (64, "lru", 200),
        (64, "lru", 1000),
        (64, "s3fifo", 200),
        (64, "s3fifo", 1000),
    ]
    # Each cell is the replay of its own pool: the one-capacity replay agrees.
    code, out, _ = run_cli(
        capsys, "--mode", "replay", "--trace", TRACE, "--block-size", "64", "--capacity", "1000",
        "--json",
    )  # fmt: skip
    assert (
        report["cells"][5]["result"]["num_hit_tokens"]
        == json.loads(out)["results"][0]["num_hit_tokens"]
    )


def test_ray_gives_byte_identical_json_to_one_job(capsys):
    pytest.importorskip("ray")
    code, one_job, _ = run_cli(capsys, *GRID, "--jobs", "1", "--json")
    assert code == 0
    code, on_ray, err = run_cli(capsys, *GRID, "--executor", "ray", "--jobs", "2", "--json")
    assert code == 0, err
    assert on_ray == one_job


def test_a_toml_grid_is_the_same_sweep_as_the_comma_lists(capsys, tmp_path):
    (tmp_path / "grid.toml").write_text(
        f'mode = "replay"\ntraces = ["{TRACE}"]\nblock_sizes = [16, 64]\n'
        'policies = ["lru", "s3fifo"]\ncapacities = [200, 1000]\n'
    )
    code, from_file, err = run_cli(capsys, "--sweep", str(tmp_path / "grid.toml"), "--json")
    assert code == 0, err
    code, from_lists, _ = run_cli(capsys, *GRID, "--json")
    assert from_file == from_lists


def test_output_csv_has_one_row_per_cell_and_metric(capsys, tmp_path):
    path = tmp_path / "results.csv"
    code, out, err = run_cli(capsys, *GRID, "--output", str(path))
    assert code == 0 and "8 cells" in out
    assert f"wrote {path} (32 rows)" in err  # 8 cells x 4 metrics
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert {row["metric"] for row in rows} == {
        "hit_rate",
        "num_hit_tokens",
        "num_prompt_tokens",
        "num_requests_not_fit",
    }
    assert sorted({int(row["cell"]) for row in rows}) == list(range(8))
    meta = json.loads((tmp_path / "results.csv.meta.json").read_text())
    assert meta["pagedkv.command"].startswith("pagedkv ")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--mode", "replay", "--executor", "ray"], "--executor ray runs a sweep's cells"),
        (["--mode", "replay", "--ray-address", "auto"], "--ray-address goes with --executor ray"),
        (["--mode", "replay", "--kv-manager", "vllm"], "go with --scheduler vllm"),
        (["--mode", "memory", "--block-size", "16,32"], "a sweep runs replay or serve cells"),
        (["--mode", "replay", "--output", "x.xlsx"], "the extension picks the format"),
        (["--mode", "replay", "--block-size", "16,16"], "a value is given twice"),
    ],
)
def test_refusals_are_one_line(capsys, argv, message):
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err


@pytest.mark.skipif(find_spec("vllm") is not None, reason="vLLM is installed here")
def test_scheduler_vllm_without_vllm_names_the_extra_before_any_work(capsys):
    code, out, err = run_cli(capsys, "--mode", "serve", "--scheduler", "vllm")
    assert code == 2 and out == ""
    expected = (
        "--scheduler vllm needs vLLM 0.33: pip install 'pagedkv[vllm]' "
        "(in a clone: pip install -e '.[vllm]')"
    )
    assert err == f"pagedkv simulate: error: {expected}\n"
