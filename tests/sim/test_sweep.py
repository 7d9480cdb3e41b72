"""`pagedkv.sim.sweep`: grids from TOML, cells in grid order, each cell the same simulation as
the mode it stands for (replay, eviction replay, serve), on any executor."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.cost_model import get_profile
from pagedkv.sim.eviction_replay import replay_policies
from pagedkv.sim.executors import LocalExecutor
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.replay import replay
from pagedkv.sim.report.sweep import sweep_report, sweep_rows
from pagedkv.sim.serve import ServeConfig, simulate_serving
from pagedkv.sim.sweep import (
    ReplayCell,
    ServeCell,
    grid_cells,
    load_grid_file,
    run_sweep,
)
from tests.support.paths import DATA_DIR


@pytest.fixture(scope="module")
def traces():
    return [
        load_trace(DATA_DIR / "mooncake_head40.jsonl"),
        load_trace(DATA_DIR / "mooncake_conversations46.jsonl"),
    ]


def replay_cells(policies, capacities, block_sizes=(16,), num_traces=2):
    return grid_cells(
        num_traces,
        block_sizes,
        [None],
        policies,
        lambda trace_index, block_size: capacities,
        lambda trace_index, block_size, profile, policy, capacity: ReplayCell(
            capacity, policy, block_size
        ),
    )


def test_cells_are_listed_trace_block_size_profile_policy_capacity():
    cells = replay_cells(["lru", "s3fifo"], [100, 400], block_sizes=(16, 64))
    assert [(c.trace_index, c.block_size, c.policy, c.capacity_blocks) for c in cells[:5]] == [
        (0, 16, "lru", 100),
        (0, 16, "lru", 400),
        (0, 16, "s3fifo", 100),
        (0, 16, "s3fifo", 400),
        (0, 64, "lru", 100),
    ]
    assert len(cells) == 2 * 2 * 2 * 2


@pytest.mark.parametrize("max_workers", [1, 2])
def test_replay_cells_equal_the_one_pass_replays(traces, max_workers):
    policies, capacities = ["lru", "s3fifo", "belady"], [100, 400]
    cells = replay_cells(policies, capacities)
    results = run_sweep(traces, cells, LocalExecutor(max_workers))
    for trace_index, trace in enumerate(traces):
        expected = {
            (point.policy, point.capacity_blocks): point.num_device_hit_tokens
            for point in replay_policies(trace, capacities, policies, 16)
        }
        got = {
            (cell.policy, cell.capacity_blocks): result["num_hit_tokens"]
            for cell, result in zip(cells, results, strict=True)
            if cell.trace_index == trace_index
        }
        assert got == expected
        lru = [point.num_hit_tokens for point in replay(trace, capacities, 16)]
        assert [got[("lru", capacity)] for capacity in capacities] == lru
    assert len(set(got.values())) > 1  # the policies differ somewhere


def test_serve_cells_equal_serve_runs_without_the_timeline(traces):
    cost = get_profile("llama3.1-8b-h100").cost_model()
    configs = [
        ServeConfig(num_blocks=num_blocks, cost_model=cost, block_size=16, max_model_len=16384)
        for num_blocks in (1200, 5000)
    ]
    cells = grid_cells(
        1,
        [16],
        ["llama3.1-8b-h100"],
        ["lru"],
        lambda trace_index, block_size: [1200, 5000],
        lambda trace_index, block_size, profile, policy, capacity: ServeCell(
            configs[[1200, 5000].index(capacity)]
        ),
    )
    results = run_sweep(traces[:1], cells, LocalExecutor(2))
    for config, result in zip(configs, results, strict=True):
        expected = simulate_serving(traces[0], config).summary
        del expected["timeline"]
        assert result == expected
    report = sweep_report("serve", traces[:1], cells, results, {"profile": "llama3.1-8b-h100"})
    header, rows = sweep_rows(report)
    assert header[:5] == ["trace", "block", "profile", "policy", "capacity (tokens)"]
    assert [row[4] for row in rows] == ["19,200", "80,000"]


def test_sweep_report_lists_cells_with_their_axes(traces):
    cells = replay_cells(["lru"], [100, None], num_traces=1)
    results = run_sweep(traces, cells, LocalExecutor(1))
    report = sweep_report("replay", traces, cells, results, {"hash_algorithm": "sha256"})
    assert report["mode"] == "sweep" and report["sweep_mode"] == "replay"
    assert [t["name"] for t in report["traces"]] == [t.name for t in traces]
    assert [(c["capacity_blocks"], c["capacity_tokens"]) for c in report["cells"]] == [
        (100, 1600),
        (None, None),
    ]
    (unlimited,) = replay(traces[0], [None], 16)
    assert report["cells"][1]["result"]["num_hit_tokens"] == unlimited.num_hit_tokens
    header, rows = sweep_rows(report)
    assert rows[1][4] == "unlimited"


def test_a_grid_file_gives_its_axes_with_paths_next_to_it(tmp_path):
    (tmp_path / "grid.toml").write_text(
        'mode = "replay"\ntraces = ["a.jsonl", "sub/b.jsonl"]\nblock_sizes = [16, 64]\n'
        'policies = ["lru", "arc"]\ncapacities = ["1Mtok", 5000]\n'
    )
    assert load_grid_file(tmp_path / "grid.toml") == {
        "mode": "replay",
        "traces": [str(tmp_path / "a.jsonl"), str(tmp_path / "sub" / "b.jsonl")],
        "block_sizes": [16, 64],
        "policies": ["lru", "arc"],
        "capacities": ["1Mtok", "5000"],
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("block_size = [16]\n", "unknown key\\(s\\) block_size; a sweep file takes"),
        ('mode = "memory"\n', "mode 'memory': a sweep is one of replay, serve"),
        ("block_sizes = 16\n", "block_sizes must be a non-empty list"),
        ("block_sizes = []\n", "block_sizes must be a non-empty list"),
        ('block_sizes = ["16"]\n', "block_sizes: '16' is not a valid value"),
        ("block_sizes = [true]\n", "block_sizes: True is not a valid value"),
        ('policies = ["lru", "lru"]\n', "policies lists a value twice"),
        ("traces = [\n", "not valid TOML"),
    ],
)
def test_bad_grid_files_are_refused_with_the_reason(tmp_path, text, message):
    path = tmp_path / "grid.toml"
    path.write_text(text)
    with pytest.raises(InvalidArgumentError, match=message):
        load_grid_file(path)


def test_a_sweep_without_cells_or_with_mixed_cells_is_refused(traces):
    with pytest.raises(InvalidArgumentError, match="the sweep has no cells"):
        run_sweep(traces, [], LocalExecutor(1))
    cost = get_profile("llama3.1-8b-h100").cost_model()
    mixed = replay_cells(["lru"], [100], num_traces=1)
    mixed += grid_cells(
        1,
        [16],
        [None],
        ["lru"],
        lambda trace_index, block_size: [100],
        lambda *axes: ServeCell(ServeConfig(num_blocks=100, cost_model=cost)),
    )
    with pytest.raises(InvalidArgumentError, match="all replays or all serve runs"):
        run_sweep(traces, mixed, LocalExecutor(1))
