"""`pagedkv simulate`'s memory study (`--mode memory`, the no-argument run): its sizes and
load from the options, the study's call, its report and plot.

Standard library only at import time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

DEFAULT_PLOT = "pagedkv-memory.png"
# Requests of the bundled sample the study serves by default (its first ~100 s): four serve
# runs of them take about 10 s of CPU, two processes on two cores (issue 12: the default run
# answers in under 10 s); `--num-requests 1000` serves the whole sample.
DEFAULT_NUM_REQUESTS = 300


def run(
    args: argparse.Namespace,
    trace: Any,
    cost_model: Any,
    serve_config: Callable[[argparse.Namespace, Any], tuple[Any, str | None]],
    make_progress: Callable[[int, str], Any],
    max_workers: int,
) -> tuple[dict[str, Any], Any]:
    """Serve the trace at each KV size; the report and the speed. Writes the plot.

    `serve_config(args, cost_model)` is simulate's own serve configuration, used as the base.
    """
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.sim import memory_study
    from pagedkv.sim.replay import parse_capacities
    from pagedkv.sim.report import Speed
    from pagedkv.sim.report.memory import memory_report

    if args.model or args.memory:
        raise InvalidArgumentError("--mode memory takes no --model/--memory yet; try --mode serve")
    profile = cost_model.get_profile(args.profile or cost_model.DEFAULT_PROFILE)
    gpu_num_blocks = profile.num_kv_blocks(args.block_size)
    if args.capacity:
        sizes = parse_capacities(args.capacity, args.block_size)
        if None in sizes:
            raise InvalidArgumentError("--mode memory takes finite sizes, not 'unlimited'")
        num_blocks_list = sorted({size for size in sizes if size is not None})
    else:
        fractions = memory_study.MEMORY_FRACTIONS
        num_blocks_list = sorted({max(1, int(gpu_num_blocks * f)) for f in fractions})
    base_args = argparse.Namespace(**{**vars(args), "capacity": None, "time_scale": 1.0})
    base, profile_name = serve_config(base_args, cost_model)
    time_scale, note = memory_study.choose_time_scale(
        trace, base.cost_model, base.scheduler.max_num_batched_tokens, args.time_scale
    )
    max_model_len = args.max_model_len or profile.max_model_len
    base = _with_time_scale(base, time_scale)
    configs = memory_study.memory_configs(base, num_blocks_list, max_model_len)
    progress = make_progress(len(trace.requests), "serving each KV size")
    start = time.perf_counter()
    try:
        points = memory_study.study_memory(trace, configs, progress, max_workers)
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    speed = Speed(wall_s, trace.num_prompt_tokens * len(configs))
    profile_info = {
        "name": profile_name,
        "kv_bytes_per_token": profile.kv_bytes_per_token,
        "gpu_num_blocks": gpu_num_blocks,
    }
    report = memory_report(trace, configs, points, profile_info, note)
    # The table comes with its plot; JSON only with an explicit --plot.
    plot_path = args.plot or (None if args.json else DEFAULT_PLOT)
    if plot_path is not None and _try_plot(report, plot_path) and not args.json:
        report["plot"] = plot_path  # shown under the table, never in the JSON
    return report, speed


def _try_plot(report: dict[str, Any], path: str) -> bool:
    """Write the plot; on failure say why on stderr and go on (the table is the answer)."""
    from pagedkv.errors import PagedKVError
    from pagedkv.sim.report.plot import plot_memory

    try:
        plot_memory(report, path)
    except (PagedKVError, OSError) as exc:
        print(f"pagedkv simulate: warning: no plot: {exc}", file=sys.stderr)
        return False
    print(f"wrote {path}", file=sys.stderr)
    return True


def _with_time_scale(config: Any, time_scale: float) -> Any:
    from dataclasses import replace

    return replace(config, time_scale=time_scale)
