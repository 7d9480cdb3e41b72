"""`pagedkv simulate`'s eviction options (`--eviction`, `--lookahead`, `--host-capacity`), their
checks and the
eviction replay's call. Standard library only at import time."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("eviction (the prefix cache's eviction policy)")
    group.add_argument(
        "--eviction",
        metavar="LIST",
        help="replay: compare eviction policies in one pass, comma-separated from lru, lfu, "
        "s3fifo, arc, cost, continuation, hazard (these two learn from sessions), belady (the "
        "offline optimum), or all; serve: one online policy (default lru, the reference's)",
    )
    group.add_argument(
        "--lookahead",
        action="store_true",
        help="serve: evict last the cached blocks that requests in the waiting queue will hit",
    )
    group.add_argument(
        "--host-capacity",
        metavar="SIZE",
        help="add a host-memory tier of SIZE blocks (20k, 1M) or tokens (4Mtok) that device "
        "victims are demoted to; replay reports device and host hits, serve makes a request "
        "wait for its host load at the profile's PCIe bandwidth",
    )


def wanted(args: argparse.Namespace) -> bool:
    return bool(args.eviction or args.host_capacity or args.lookahead)


def check(args: argparse.Namespace, error: Callable[[str], Exception]) -> None:
    """Refuse combinations the eviction options do not support, before any work."""
    if not wanted(args):
        return
    if args.model:
        raise error("--eviction and --host-capacity need the synthetic layout, not --model")
    if args.lookahead and args.mode != "serve":
        raise error("--lookahead is for --mode serve (in replay nothing waits)")
    if args.mode == "serve" and args.eviction and "," in args.eviction:
        raise error("--mode serve takes one --eviction policy (a comparison is for replay)")
    if args.no_prefix_caching:
        raise error("--eviction and --host-capacity need prefix caching")


def host_num_blocks(args: argparse.Namespace) -> int:
    """The host tier's capacity in blocks (0 without --host-capacity)."""
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.sim.replay import parse_capacities

    if not args.host_capacity:
        return 0
    capacities = parse_capacities(args.host_capacity, args.block_size)
    if len(capacities) != 1 or capacities[0] is None:
        raise InvalidArgumentError(
            f"--host-capacity {args.host_capacity!r}: give one finite size (blocks or tokens)"
        )
    return capacities[0]


def serve_options(args: argparse.Namespace, profile: Any) -> dict[str, Any]:
    """ServeConfig fields for the eviction options."""
    num_blocks = host_num_blocks(args)
    return {
        "eviction": (args.eviction or "lru").strip().lower(),
        "lookahead": bool(args.lookahead),
        "host_num_blocks": num_blocks,
        "host_load_s_per_token": profile.host_load_s_per_token if num_blocks else 0.0,
    }


def replay(
    args: argparse.Namespace, trace: Any, make_progress: Callable[[int, str], Any]
) -> tuple[dict, Any, Callable[[str], None]]:
    """Replay every policy at every capacity; return the report, the speed and the plotter."""
    from pagedkv.sim import replay as replay_module
    from pagedkv.sim.eviction_replay import parse_policies, replay_policies
    from pagedkv.sim.report import REPORT_FORMAT, Speed
    from pagedkv.sim.report.eviction import eviction_report, plot_eviction

    policies = parse_policies(args.eviction or "lru")
    if args.capacity:
        capacities = replay_module.parse_capacities(args.capacity, args.block_size)
    else:
        capacities = list(replay_module.default_capacities(trace, args.block_size))
        capacities = capacities[:-1] or capacities  # the largest never evicts: all equal
    host = host_num_blocks(args)
    progress = make_progress(len(trace.requests), "replaying")
    start = time.perf_counter()
    try:
        points = replay_policies(
            trace,
            capacities,  # type: ignore[arg-type]  # None is refused with a clear error
            policies,
            args.block_size,
            args.hash_algorithm,
            host,
            progress,
            hash_tokens=args.hash_tokens,
        )
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    speed = Speed(wall_s, trace.num_prompt_tokens * len(points))
    report = eviction_report(trace, points, args.block_size, args.hash_algorithm, REPORT_FORMAT)

    def plot(path: str) -> None:
        plot_eviction(report, path)

    return report, speed, plot
