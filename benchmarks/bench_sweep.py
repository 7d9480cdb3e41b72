"""How a sweep scales (issue 21), run by hand: cells per second on one core, and the wall time of
the same sweep in this process, in forked workers and on a local Ray with 1 and 2 workers.

The sweep is replay cells of the bundled Mooncake sample (1,000 requests): block sizes x
eviction policies x capacities, each cell its own replay, as `pagedkv simulate --mode replay
--sweep ...` runs them. Ray's start-up (ray.init) is timed apart from the sweep. Prints a
Markdown table and one JSON line. Needs the [ray] extra.

    python benchmarks/bench_sweep.py [--block-sizes 16 32 64 128] [--policies lru s3fifo]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from importlib import resources

from pagedkv.sim.executors import LocalExecutor, RayExecutor
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.replay import default_capacities
from pagedkv.sim.sweep import ReplayCell, grid_cells, run_sweep


def make_cells(trace, block_sizes: list[int], policies: list[str], num_capacities: int) -> list:
    def capacities(trace_index: int, block_size: int) -> list[int]:
        return default_capacities(trace, block_size)[:num_capacities]

    def argument(trace_index, block_size, profile, policy, capacity):
        return ReplayCell(capacity, policy, block_size)

    return grid_cells(1, block_sizes, [None], policies, capacities, argument)


def timed(executor, trace, cells) -> tuple[float, list]:
    start = time.perf_counter()
    results = run_sweep([trace], cells, executor)
    return time.perf_counter() - start, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[16, 32, 64, 128])
    parser.add_argument("--policies", nargs="+", default=["lru", "s3fifo", "arc", "lfu"])
    parser.add_argument("--capacities", type=int, default=2, help="per block size (smallest)")
    args = parser.parse_args()
    import ray

    sample = resources.files("pagedkv") / "data" / "mooncake_conversation_sample.jsonl"
    with resources.as_file(sample) as path:
        trace = load_trace(path)
    cells = make_cells(trace, args.block_sizes, args.policies, args.capacities)
    rows: dict[str, dict] = {}
    wall_s, reference = timed(LocalExecutor(1), trace, cells)
    rows["this process (1 core)"] = {"wall_s": wall_s}
    wall_s, results = timed(LocalExecutor(2), trace, cells)
    assert results == reference
    rows["2 forked workers"] = {"wall_s": wall_s}
    for num_cpus in (1, 2):
        start = time.perf_counter()
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        init_s = time.perf_counter() - start
        try:
            wall_s, results = timed(RayExecutor(), trace, cells)
        finally:
            ray.shutdown()
        assert results == reference
        rows[f"Ray, {num_cpus} worker{'s' if num_cpus > 1 else ''}"] = {
            "wall_s": wall_s,
            "ray_init_s": init_s,
        }
    print(f"{len(cells)} replay cells of the sample ({len(trace.requests):,} requests each)")
    print("| executor | sweep wall (s) | cells/s | ray.init (s) |")
    print("|---|---:|---:|---:|")
    for name, row in rows.items():
        init = f"{row['ray_init_s']:.1f}" if "ray_init_s" in row else "-"
        print(f"| {name} | {row['wall_s']:.1f} | {len(cells) / row['wall_s']:.2f} | {init} |")
    print(
        json.dumps(
            {
                "python": platform.python_version(),
                "ray": ray.__version__,
                "num_cells": len(cells),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
