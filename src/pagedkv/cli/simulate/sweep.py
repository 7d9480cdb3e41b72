"""CLI of `pagedkv simulate`: sweeps (`--sweep FILE`, comma lists), where their cells run
(`--executor local|ray`, `--ray-address`) and vLLM's scheduler (`--scheduler vllm`).

Standard library only at import time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from pagedkv.cli._checks import int_at_least
from pagedkv.errors import install_hint

SCHEDULERS = ("pagedkv", "vllm")
EXECUTORS = ("local", "ray")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sweeps and schedulers")
    group.add_argument(
        "--sweep",
        metavar="FILE",
        help="a TOML grid (mode, traces, block_sizes, profiles, policies, capacities): every "
        "combination is one cell, run by --executor; comma lists in --trace, --block-size, "
        "--profile (and, in serve mode, --capacity and --eviction) make a grid too",
    )
    group.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="local",
        help="where independent runs go: local (worker processes, --jobs) or ray (one Ray "
        "task per cell; extra [ray]) (default local)",
    )
    group.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --executor ray: the cluster to join (ray://host:10001, auto) (default "
        "a local Ray with --jobs CPUs)",
    )
    group.add_argument(
        "--scheduler",
        choices=SCHEDULERS,
        default="pagedkv",
        help="serve mode's scheduler: pagedkv's reference scheduler, or vLLM 0.33's own "
        "(extra [vllm]) (default pagedkv)",
    )
    group.add_argument(
        "--kv-manager",
        choices=("pagedkv", "vllm"),
        default="pagedkv",
        help="with --scheduler vllm: pagedkv's KV-cache manager (the drop-in) or vLLM's own",
    )
    group.add_argument(
        "--async-scheduling",
        action="store_true",
        help="with --scheduler vllm: vLLM's async scheduling (the next batch is scheduled "
        "while the current one runs)",
    )


def list_of(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type: a comma-separated list of `kind` values (at least one, no repeats)."""

    def parse(text: str) -> list[Any]:
        values = [kind(item.strip()) for item in text.split(",") if item.strip()]
        if not values:
            raise argparse.ArgumentTypeError(f"expected a value, got {text!r}")
        if len(set(values)) != len(values):
            raise argparse.ArgumentTypeError(f"a value is given twice in {text!r}")
        return values

    parse.__name__ = getattr(kind, "__name__", "value") + " list"
    return parse


block_sizes_type = list_of(int_at_least(1))


def block_sizes_text(text: str) -> str:
    """An argparse type: `--block-size` as given (one or a comma list), checked now; `normalize`
    turns it into ints (the text keeps `resolve_mode`'s comparison with the default simple)."""
    block_sizes_type(text)
    return text


def normalize(
    args: argparse.Namespace, error: Callable[[str], Exception], mode_given: bool
) -> None:
    """Give the run its axes: `traces`, `block_sizes`, `profiles` (lists), from the comma
    lists or the `--sweep` file, and `block_size` / `trace` / `profile` as their first values
    (what a run with one value uses). A file's axis replaces the command line's; both is an
    error."""
    from pagedkv.sim.sweep import load_grid_file

    grid = load_grid_file(args.sweep) if args.sweep else {}
    given = {
        "traces": args.trace,
        "block_sizes": args.block_size != "16",
        "profiles": args.profile,
        "policies": args.eviction,
        "capacities": args.capacity,
        "mode": mode_given,
    }
    both = [axis for axis in grid if given.get(axis)]
    if both:
        raise error(f"--sweep {args.sweep} gives {', '.join(both)}: drop the command-line one")
    if "mode" in grid:
        args.mode = grid["mode"]
    if grid.get("policies"):
        args.eviction = ",".join(grid["policies"])
    if grid.get("capacities"):
        args.capacity = ",".join(grid["capacities"])
    args.traces = grid.get("traces") or (
        [t for t in args.trace.split(",") if t] if args.trace else []
    )
    args.block_sizes = grid.get("block_sizes") or block_sizes_type(args.block_size)
    args.profiles = grid.get("profiles") or (args.profile.split(",") if args.profile else [None])
    args.trace = args.traces[0] if args.traces else None
    args.block_size = args.block_sizes[0]
    args.profile = args.profiles[0]


def wanted(args: argparse.Namespace) -> bool:
    """A grid of cells: a sweep file, several traces, block sizes or profiles, or (serve mode)
    several capacities or eviction policies."""
    several = len(args.traces) > 1 or len(args.block_sizes) > 1 or len(args.profiles) > 1
    serve_lists = args.mode == "serve" and (
        "," in (args.capacity or "") or "," in (args.eviction or "")
    )
    return bool(args.sweep) or several or serve_lists


def check(args: argparse.Namespace, error: Callable[[str], Exception]) -> None:
    """Refuse what these options cannot do, before any work (vLLM's extra is looked for first:
    one line saying what to install)."""
    from importlib.util import find_spec

    if args.scheduler == "vllm":
        if find_spec("vllm") is None:
            raise error(f"--scheduler vllm needs vLLM 0.33: {install_hint('vllm')}")
        if args.mode != "serve":
            raise error("--scheduler vllm drives serve mode only (add --mode serve)")
    elif args.kv_manager != "pagedkv" or args.async_scheduling:
        raise error("--kv-manager and --async-scheduling go with --scheduler vllm")
    if args.executor == "ray" and find_spec("ray") is None:
        raise error(f"--executor ray needs Ray: {install_hint('ray')}")
    if args.ray_address and args.executor != "ray":
        raise error("--ray-address goes with --executor ray")
    if not wanted(args):
        if args.executor == "ray":
            raise error(
                "--executor ray runs a sweep's cells (--sweep FILE, or comma lists in --trace, "
                "--block-size, --profile; in serve mode --capacity, --eviction too); one run, a "
                "replay capacity list and the memory study use local processes (--jobs)"
            )
        return
    if args.mode not in ("replay", "serve"):
        raise error("a sweep runs replay or serve cells: add --mode replay or --mode serve")
    refused = {
        "--model": args.model,
        "--host-capacity": args.host_capacity,
        "--instances": getattr(args, "instances", 1) not in (None, 1),
        "--plot": args.plot,
        "--workload": args.workload,
    }
    for flag, is_set in refused.items():
        if is_set:
            raise error(f"a sweep does not take {flag} yet")


def make_executor(args: argparse.Namespace, max_workers: int) -> Any:
    from pagedkv.sim.executors import LocalExecutor, RayExecutor

    if args.executor == "ray":
        return RayExecutor(args.ray_address, num_cpus=max_workers)
    return LocalExecutor(max_workers)


def vllm_options(args: argparse.Namespace) -> Any:
    """vLLM's scheduler options (None: the reference scheduler)."""
    if args.scheduler != "vllm":
        return None
    from pagedkv.sim.vllm_options import VllmOptions

    return VllmOptions(args.kv_manager, args.async_scheduling)


def cells(args: argparse.Namespace, traces: list[Any], serve_config: Any) -> list[Any]:
    """The grid's cells (the traces loaded, `serve_config(args)` building a serve run's)."""
    from pagedkv.sim.eviction_replay import parse_policies
    from pagedkv.sim.replay import default_capacities, parse_capacities
    from pagedkv.sim.sweep import ReplayCell, ServeCell, grid_cells

    policies = parse_policies(args.eviction) if args.eviction else ["lru"]

    def capacities(trace_index: int, block_size: int) -> list[int | None]:
        if args.capacity:
            return parse_capacities(args.capacity, block_size)
        if args.mode == "replay":
            return list(default_capacities(traces[trace_index], block_size))
        return [None]  # serve: what the profile's GPU holds

    if args.mode == "replay":

        def replay_argument(
            trace_index: int, block_size: int, profile: Any, policy: str, capacity: Any
        ) -> Any:
            return ReplayCell(capacity, policy, block_size, args.hash_algorithm, args.hash_tokens)

        return grid_cells(
            len(traces), args.block_sizes, [None], policies, capacities, replay_argument
        )
    options = vllm_options(args)

    def serve_argument(
        trace_index: int, block_size: int, profile: Any, policy: str, capacity: Any
    ) -> Any:
        if capacity is None and args.capacity:
            raise_unlimited()
        cell_args = argparse.Namespace(
            **{
                **vars(args),
                "block_size": block_size,
                "profile": profile,
                "eviction": policy,
                "capacity": None if capacity is None else str(capacity),
            }
        )
        config, _ = serve_config(cell_args)
        if options is not None:
            from pagedkv.sim.vllm_options import check_supported

            check_supported(config)
        return ServeCell(config, options)

    return grid_cells(
        len(traces), args.block_sizes, args.profiles, policies, capacities, serve_argument
    )


def raise_unlimited() -> None:
    from pagedkv.errors import InvalidArgumentError

    raise InvalidArgumentError("serve cells take finite capacities, not 'unlimited'")


def report_config(args: argparse.Namespace) -> dict[str, Any]:
    """What every cell of the sweep shares (the axes are in the cells)."""
    config: dict[str, Any] = {
        "hash_algorithm": args.hash_algorithm,
        "hash_tokens": args.hash_tokens,
    }
    if args.mode == "serve":
        config.update(
            {
                "time_scale": args.time_scale,
                "max_num_batched_tokens": args.max_num_batched_tokens,
                "max_num_seqs": args.max_num_seqs,
                "policy": args.policy,
                "scheduler": args.scheduler,
            }
        )
        if args.scheduler == "vllm":
            config["vllm"] = {
                "kv_manager": args.kv_manager,
                "async_scheduling": args.async_scheduling,
            }
    return config


def run(
    args: argparse.Namespace,
    traces: list[Any],
    grid: list[Any],
    executor: Any,
    make_progress: Callable[[int, str], Any],
) -> tuple[dict[str, Any], float, int]:
    """Run the cells; the sweep report, the wall time and the simulated prompt tokens."""
    from pagedkv.sim.report.sweep import sweep_report
    from pagedkv.sim.sweep import run_sweep

    progress = make_progress(len(grid), "cells")
    start = time.perf_counter()
    try:
        results = run_sweep(traces, grid, executor, progress)
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    num_tokens = sum(traces[cell.trace_index].num_prompt_tokens for cell in grid)
    report = sweep_report(args.mode, traces, grid, results, report_config(args))
    return report, wall_s, num_tokens
