"""Simulator layer: a sweep, the grid of (trace, block size, profile, policy, capacity) cells.

Each cell is one independent simulation (a replay of one capacity and eviction policy, or a
serve run), computed by a module-level job that an executor runs anywhere (`executors`); the
report lists the cells in grid order, so it is the same wherever they ran. A grid comes from
comma lists or a TOML file (`load_grid_file`). Knows nothing of the command line.
"""

from __future__ import annotations

import itertools
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.executors import CellsDone, Executor, JobProgress
from pagedkv.sim.inputs.traces import Trace

# The axes of a grid, in the order cells are listed (the last varies fastest).
AXES = ("traces", "block_sizes", "profiles", "policies", "capacities")
_GRID_KEYS = {"mode", *AXES}
SWEEP_MODES = ("replay", "serve")


@dataclass(frozen=True, slots=True)
class SweepCell:
    """One cell: which trace (an index into the sweep's traces) and the axis values.

    `capacity_blocks` None: unlimited (replay only). `profile` None in replay (no clock).
    `argument` is what the cell's job gets besides the trace (`ReplayCell` or `ServeCell`).
    """

    trace_index: int
    block_size: int
    profile: str | None
    policy: str
    capacity_blocks: int | None
    argument: Any


@dataclass(frozen=True, slots=True)
class ReplayCell:
    """A replay of one pool: `policy` at `capacity_blocks` (None: unlimited)."""

    capacity_blocks: int | None
    policy: str
    block_size: int
    hash_algorithm: str = "sha256"
    hash_tokens: bool = False


@dataclass(frozen=True, slots=True)
class ServeCell:
    """A serve run: its whole `ServeConfig`, and vLLM's scheduler options (None: pagedkv's
    reference scheduler)."""

    config: Any  # ServeConfig
    vllm: Any = None  # VllmOptions


def load_grid_file(path: str | Path) -> dict[str, Any]:
    """The grid of a TOML sweep file: any of `mode`, `traces`, `block_sizes`, `profiles`,
    `policies`, `capacities` (each axis a list); trace paths are relative to the file.

    Example::

        mode = "replay"
        traces = ["conversation.jsonl", "synthetic.jsonl"]
        block_sizes = [16, 64]
        policies = ["lru", "s3fifo"]
        capacities = ["1Mtok", "4Mtok"]
    """
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise InvalidArgumentError(f"{path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise InvalidArgumentError(f"{path}: not UTF-8 text; a sweep file is TOML") from None
    unknown = sorted(set(data) - _GRID_KEYS)
    if unknown:
        raise InvalidArgumentError(
            f"{path}: unknown key(s) {', '.join(unknown)}; a sweep file takes "
            f"{', '.join(sorted(_GRID_KEYS))}"
        )
    grid: dict[str, Any] = {}
    if "mode" in data:
        if data["mode"] not in SWEEP_MODES:
            raise InvalidArgumentError(
                f"{path}: mode {data['mode']!r}: a sweep is one of {', '.join(SWEEP_MODES)}"
            )
        grid["mode"] = data["mode"]
    kinds: dict[str, type | tuple[type, ...]] = {
        "traces": str,
        "block_sizes": int,
        "profiles": str,
        "policies": str,
        "capacities": (str, int),
    }
    for axis in AXES:
        if axis not in data:
            continue
        values = data[axis]
        if not isinstance(values, list) or not values:
            raise InvalidArgumentError(f"{path}: {axis} must be a non-empty list")
        for value in values:
            if not isinstance(value, kinds[axis]) or isinstance(value, bool):
                raise InvalidArgumentError(f"{path}: {axis}: {value!r} is not a valid value")
        if len(set(values)) != len(values):
            raise InvalidArgumentError(f"{path}: {axis} lists a value twice")
        if axis == "traces":
            values = [str((path.parent / value).resolve()) for value in values]
        elif axis == "capacities":
            values = [str(value) for value in values]
        grid[axis] = values
    return grid


def grid_cells(
    num_traces: int,
    block_sizes: Sequence[int],
    profiles: Sequence[str | None],
    policies: Sequence[str],
    capacities: Any,
    make_argument: Any,
) -> list[SweepCell]:
    """Every cell of the grid, in `AXES` order.

    `capacities(trace_index, block_size)` gives that trace's capacities in blocks (defaults
    may depend on the trace); `make_argument(trace_index, block_size, profile, policy,
    capacity_blocks)` builds the cell's job argument.
    """
    cells = []
    for trace_index, block_size, profile, policy in itertools.product(
        range(num_traces), block_sizes, profiles, policies
    ):
        for capacity in capacities(trace_index, block_size):
            cells.append(
                SweepCell(
                    trace_index,
                    block_size,
                    profile,
                    policy,
                    capacity,
                    make_argument(trace_index, block_size, profile, policy, capacity),
                )
            )
    return cells


def run_sweep(
    traces: Sequence[Trace],
    cells: Sequence[SweepCell],
    executor: Executor,
    progress: CellsDone | None = None,
) -> list[dict[str, Any]]:
    """Every cell's result, in cell order (whichever executor ran them)."""
    if not cells:
        raise InvalidArgumentError("the sweep has no cells")
    modes = {type(cell.argument) for cell in cells}
    if len(modes) != 1:
        raise InvalidArgumentError("a sweep's cells are all replays or all serve runs")
    job = replay_cell if modes == {ReplayCell} else serve_cell
    tasks = [(cell.trace_index, cell.argument) for cell in cells]
    return executor.run(job, traces, tasks, progress)


def replay_cell(trace: Trace, cell: ReplayCell, report: JobProgress) -> dict[str, Any]:
    """One pool's hits: the plain replay for LRU, the eviction replay for another policy."""
    if cell.policy == "lru" or cell.capacity_blocks is None:
        from pagedkv.sim.replay import replay

        (point,) = replay(
            trace,
            [cell.capacity_blocks],
            cell.block_size,
            cell.hash_algorithm,
            report,
            hash_tokens=cell.hash_tokens,
        )
        num_hit_tokens = point.num_hit_tokens
        num_not_fit = point.num_requests_not_fit
    else:
        from pagedkv.sim.eviction_replay import replay_policies

        (policy_point,) = replay_policies(
            trace,
            [cell.capacity_blocks],
            [cell.policy],
            cell.block_size,
            cell.hash_algorithm,
            progress=report,
        )
        num_hit_tokens = policy_point.num_device_hit_tokens
        num_not_fit = policy_point.num_requests_not_fit
    num_prompt_tokens = trace.num_prompt_tokens
    return {
        "hit_rate": _sig6(num_hit_tokens / num_prompt_tokens if num_prompt_tokens else 0.0),
        "num_hit_tokens": num_hit_tokens,
        "num_prompt_tokens": num_prompt_tokens,
        "num_requests_not_fit": num_not_fit,
    }


def serve_cell(trace: Trace, cell: ServeCell, report: JobProgress) -> dict[str, Any]:
    """One serve run's summary, without its timeline (a sweep compares cells, not curves)."""
    if cell.vllm is None:
        from pagedkv.sim.serve import ServeRun

        run = ServeRun(trace, cell.config)
        run.run(report)
        summary = run.summary()
    else:
        from pagedkv.sim.vllm_serve import simulate_serving_vllm

        summary = simulate_serving_vllm(trace, cell.config, cell.vllm, report).summary
    summary.pop("timeline", None)
    return summary


def _sig6(value: float) -> float:
    return float(f"{value:.6g}")
