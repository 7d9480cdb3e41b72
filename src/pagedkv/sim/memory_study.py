"""Simulator layer: the memory study, how much KV memory a workload needs and what it buys.

The trace is served at several KV-cache sizes, fractions and multiples of what the profile's
GPU holds, at an arrival rate the GPU can carry: arrivals are slowed until the roofline work
of serving the trace without prefix hits fills a target share of the time. Each size is an
independent serve run (in worker processes when there are several cores); each reports hit
rate, latency, preemptions and rejections.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim import processes
from pagedkv.sim.cost_model import LinearCostModel
from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.processes import JobProgress, ProgressCallback
from pagedkv.sim.serve import ServeConfig, ServeRun

# KV memory per row, as fractions of what the profile's GPU holds after the weights: four
# sizes, so two cores serve them in two rounds.
MEMORY_FRACTIONS = (0.25, 0.5, 1.0, 2.0)
# Share of the time the GPU would be busy serving the trace without prefix hits.
TARGET_BUSY_FRACTION = 0.7


def estimate_busy_s(
    trace: Trace, cost_model: LinearCostModel, max_num_batched_tokens: int
) -> float:
    """Roofline GPU seconds to serve the whole trace with no prefix hit, in full batches.

    Every prompt token is computed (attention over all earlier tokens of its prompt, KV read
    chunk by chunk), every output token is one decode of the whole context, and the per-step
    overhead is paid once per `max_num_batched_tokens` scheduled tokens, as under heavy load.
    """
    busy_s = 0.0
    num_tokens = 0
    for request in trace.requests:
        num_prompt = request.num_prompt_tokens
        num_output = request.num_output_tokens
        busy_s += cost_model.prefill_token_s * num_prompt
        busy_s += cost_model.prefill_attention_pair_s * num_prompt * (num_prompt + 1) / 2
        # KV read by the prompt's chunks: chunk i reads the i * chunk tokens up to its end.
        num_chunks = -(-num_prompt // max_num_batched_tokens)
        num_read = max_num_batched_tokens * (num_chunks - 1) * num_chunks / 2 + num_prompt
        busy_s += cost_model.kv_token_read_s * num_read
        busy_s += cost_model.decode_seq_s * num_output
        busy_s += cost_model.kv_token_read_s * num_output * (num_prompt + num_output / 2)
        num_tokens += num_prompt + num_output
    return busy_s + cost_model.step_overhead_s * num_tokens / max_num_batched_tokens


def carried_time_scale(
    trace: Trace,
    cost_model: LinearCostModel,
    max_num_batched_tokens: int,
    busy_fraction: float = TARGET_BUSY_FRACTION,
) -> float:
    """The arrival time scale (>= 1, two significant digits, rounded up) at which the GPU is
    busy at most `busy_fraction` of the trace's (scaled) duration; 1 for a trace without
    duration."""
    if not 0 < busy_fraction <= 1:
        raise InvalidArgumentError(f"busy_fraction must be in (0, 1], got {busy_fraction!r}")
    if trace.duration_s <= 0:
        return 1.0
    busy_s = estimate_busy_s(trace, cost_model, max_num_batched_tokens)
    scale = busy_s / (busy_fraction * trace.duration_s)
    if scale <= 1:
        return 1.0
    exponent = math.floor(math.log10(scale)) - 1  # of the second significant digit
    if exponent >= 0:
        return float(math.ceil(scale / 10**exponent) * 10**exponent)
    factor = 10**-exponent
    # Rounded before ceil so that 6.3 stays 6.3 (6.3 * 10 is 63.00000000000001).
    return math.ceil(round(scale * factor, 9)) / factor


def choose_time_scale(
    trace: Trace,
    cost_model: LinearCostModel,
    max_num_batched_tokens: int,
    time_scale: float | None,
) -> tuple[float, str]:
    """The study's arrival time scale and the report's line on the load it gives: `time_scale`
    when one is given (`--time-scale`), else `carried_time_scale`'s (1 without a duration)."""
    if time_scale is not None:
        return time_scale, f"arrivals at {time_scale:g}x the trace's times (--time-scale)"
    if trace.duration_s <= 0:
        return 1.0, "every request arrives at once (the trace has no duration)"
    scale = carried_time_scale(trace, cost_model, max_num_batched_tokens)
    busy_s = estimate_busy_s(trace, cost_model, max_num_batched_tokens)
    busy = busy_s / (scale * trace.duration_s)
    return scale, (
        f"arrivals {scale:g}x slower than the trace, so the GPU is busy about "
        f"{100 * busy:.0f} % of the time without prefix hits (roofline estimate); "
        "--time-scale sets another load"
    )


@dataclass(frozen=True)
class MemoryPoint:
    """One KV-cache size: its usable blocks and the serve run's summary (`ServeRun.summary`)."""

    num_blocks: int
    summary: dict[str, Any]


def study_memory(
    trace: Trace,
    configs: Sequence[ServeConfig],
    progress: ProgressCallback | None = None,
    max_workers: int = 1,
) -> list[MemoryPoint]:
    """Serve the trace once per configuration (one per KV size), in up to `max_workers`
    processes; points in the given order. `progress` gets the mean requests done per run."""
    if not configs:
        raise InvalidArgumentError("the memory study needs at least one KV-cache size")
    arguments = [(trace, config) for config in configs]
    if max_workers > 1 and len(configs) > 1 and processes.can_fork():
        summaries = processes.run_jobs(
            _serve_job, arguments, max_workers, len(trace.requests), progress
        )
    else:
        summaries = []
        for index, argument in enumerate(arguments):
            done_before = index * len(trace.requests)

            def report(num_done: int, done_before: int = done_before) -> None:
                if progress is not None:
                    progress((done_before + num_done) // len(arguments))

            summaries.append(_serve_job(argument, report))
    return [
        MemoryPoint(config.num_blocks, summary)
        for config, summary in zip(configs, summaries, strict=True)
    ]


def memory_configs(
    base: ServeConfig, num_blocks_list: Sequence[int], max_model_len: int
) -> list[ServeConfig]:
    """`base` at each pool size; a request must fit the pool, so `max_model_len` is capped by it."""
    configs = []
    for num_blocks in num_blocks_list:
        length = min(max_model_len, num_blocks * base.block_size)
        scheduler = replace(base.scheduler, max_model_len=length)
        configs.append(
            replace(base, num_blocks=num_blocks, max_model_len=length, scheduler=scheduler)
        )
    return configs


def _serve_job(argument: tuple[Trace, ServeConfig], report: JobProgress) -> dict[str, Any]:
    trace, config = argument
    run = ServeRun(trace, config)
    run.run(report)
    return run.summary()
