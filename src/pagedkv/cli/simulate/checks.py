"""`pagedkv simulate`'s checks before any long work: the options that need no trace, then the
trace itself (fail fast, one line naming the flag and the value).

Standard library only at import time.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from pagedkv.cli._checks import check_hash_algorithm, check_plot_file


def check_pools_fit(what: str, num_blocks: int) -> None:
    """Pools of `num_blocks` blocks in all fit in this machine's memory."""
    from pagedkv.memory_guard import BYTES_PER_POOL_BLOCK, check_fits

    check_fits(what, num_blocks * BYTES_PER_POOL_BLOCK)


def check_simulate_args(args: argparse.Namespace, cost_model: Any, *, cluster: bool) -> None:
    """`pagedkv simulate`: every check that needs no trace, before loading one (extras,
    output file, profile, memory for the pools or the workload). `cluster`: several
    instances will run (their own checks are `cluster.preflight`)."""
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.memory_guard import BYTES_PER_WORKLOAD_REQUEST, check_fits
    from pagedkv.sim.replay import parse_capacities

    check_hash_algorithm(args.hash_algorithm)
    if args.plot:
        if cluster:
            raise InvalidArgumentError("--plot is not available with --instances/--metrics-port")
        args.plot = str(check_plot_file(args.plot))
    profile = cost_model.get_profile(args.profile or cost_model.DEFAULT_PROFILE)
    if args.cost:
        model = profile.cost_model().with_overrides(cost_model.parse_cost_overrides(args.cost))
        if not any(asdict(model).values()):
            raise InvalidArgumentError(
                f"--cost {args.cost}: every coefficient is 0, so steps would take no simulated "
                "time (every latency 0, throughput infinite)"
            )
    if args.capacity:
        capacities = parse_capacities(args.capacity, args.block_size)
        num_blocks = sum(capacity + 1 for capacity in capacities if capacity is not None)
        if cluster:
            num_blocks *= args.instances or 1
        check_pools_fit(f"--capacity {args.capacity}", num_blocks)
    if args.workload:
        num_requests = args.num_requests or 400
        check_fits(
            f"--workload {args.workload} --num-requests {num_requests:,}",
            num_requests * BYTES_PER_WORKLOAD_REQUEST,
        )


def check_simulate_trace(args: argparse.Namespace, trace: Any) -> None:
    """`pagedkv simulate`: the checks that need the trace (scaled arrival times stay exact;
    the longest prompt fits in memory for replay)."""
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.memory_guard import BYTES_PER_PROMPT_TOKEN, check_fits
    from pagedkv.sim.inputs.traces import MAX_TIMESTAMP_MS

    last_arrival_s = max((r.arrival_time_s for r in trace.requests), default=0.0)
    max_s = MAX_TIMESTAMP_MS / 1000
    if args.mode == "serve" and last_arrival_s * args.time_scale > max_s:
        raise InvalidArgumentError(
            f"the last request arrives at {last_arrival_s * args.time_scale:.3g} s (time scale "
            f"{args.time_scale:g}); simulated times stay exact up to {max_s:.0e} s: lower "
            "--time-scale" + (" or raise --rate" if args.workload else "")
        )
    if args.mode == "replay":
        longest = max(trace.requests, key=lambda r: r.num_prompt_tokens)
        check_fits(
            f"replaying request {longest.request_id} ({longest.num_prompt_tokens:,} prompt tokens)",
            longest.num_prompt_tokens * BYTES_PER_PROMPT_TOKEN,
        )
