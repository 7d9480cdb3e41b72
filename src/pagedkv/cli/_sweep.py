"""CLI helper of `pagedkv simulate`: sweeps (`--sweep FILE`, comma lists), where their cells run
(`--executor local|ray`, `--ray-address`) and vLLM's scheduler (`--scheduler vllm`).

Not a command itself (the leading underscore); standard library only at import time.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

from pagedkv.cli._checks import int_at_least

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
        "task per cell; extra [ray]); default local",
    )
    group.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --executor ray: the cluster to join (ray://host:10001, auto); default: "
        "start a local Ray with --jobs CPUs",
    )
    group.add_argument(
        "--scheduler",
        choices=SCHEDULERS,
        default="pagedkv",
        help="serve mode's scheduler: pagedkv's reference scheduler, or vLLM 0.33's own "
        "(extra [vllm]); default pagedkv",
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


def check(args: argparse.Namespace, error: Callable[[str], Exception]) -> None:
    """Refuse what these options cannot do, before any work (vLLM's extra is looked for first:
    one line saying what to install)."""
    from importlib.util import find_spec

    if args.scheduler == "vllm":
        if find_spec("vllm") is None:
            raise error("--scheduler vllm needs vLLM 0.33: pip install 'pagedkv[vllm]'")
        if args.mode != "serve":
            raise error("--scheduler vllm drives serve mode only (add --mode serve)")
    elif args.kv_manager != "pagedkv" or args.async_scheduling:
        raise error("--kv-manager and --async-scheduling go with --scheduler vllm")
    if args.executor == "ray" and find_spec("ray") is None:
        raise error("--executor ray needs Ray: pip install 'pagedkv[ray]'")
    if args.ray_address and args.executor != "ray":
        raise error("--ray-address goes with --executor ray")


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


def run(
    args: argparse.Namespace,
    traces: list[Any],
    cells: list[Any],
    config: dict[str, Any],
    executor: Any,
    make_progress: Callable[[int, str], Any],
) -> tuple[dict[str, Any], float, int]:
    """Run the cells; the sweep report, the wall time and the simulated prompt tokens."""
    from pagedkv.sim.sweep import run_sweep, sweep_report

    progress = make_progress(len(cells), "cells")
    start = time.perf_counter()
    try:
        results = run_sweep(traces, cells, executor, progress)
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    num_tokens = sum(traces[cell.trace_index].num_prompt_tokens for cell in cells)
    mode = "replay" if args.mode == "replay" else "serve"
    return sweep_report(mode, traces, cells, results, config), wall_s, num_tokens
