"""Simulator layer: serve mode, time-stepped serving of a trace through the reference scheduler.

Requests arrive at their (scaled) timestamps; each step's duration comes from a cost model.
Sampled tokens are the trace's deterministic output ids. The clock is simulated: the result
depends only on the inputs, never on the machine running it.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.hashing import make_request_block_hasher
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from pagedkv.sched import (
    FCFSPolicy,
    PriorityPolicy,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
)
from pagedkv.sim.cost_model import LinearCostModel
from pagedkv.sim.traces import Trace, TraceRequest
from pagedkv.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

ProgressCallback = Callable[[int], None]  # called with the number of requests done so far
POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
}


@dataclass(frozen=True)
class ServeConfig:
    """Everything serve mode needs besides the trace.

    `num_blocks` counts usable blocks (the pool gets one more, the null block).
    `time_scale` multiplies every arrival time (0.5 replays the trace twice as fast).
    """

    num_blocks: int
    cost_model: LinearCostModel
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    block_size: int = 16
    max_model_len: int = 131072
    policy: str = "fcfs"
    time_scale: float = 1.0
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    hash_algorithm: str = "sha256"
    num_timeline_points: int = 120

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0, got {self.time_scale!r}")


@dataclass
class ServeResult:
    """Per-request latencies, totals and the per-step time series (for plots)."""

    summary: dict[str, Any]
    step_start_s: array = field(default_factory=lambda: array("d"))
    step_usage: array = field(default_factory=lambda: array("d"))
    step_num_running: array = field(default_factory=lambda: array("l"))
    step_num_waiting: array = field(default_factory=lambda: array("l"))


class _Timing:
    __slots__ = ("trace_request", "arrival_s", "first_token_s")

    def __init__(self, trace_request: TraceRequest, arrival_s: float) -> None:
        self.trace_request = trace_request
        self.arrival_s = arrival_s
        self.first_token_s: float | None = None


def simulate_serving(
    trace: Trace, config: ServeConfig, progress: ProgressCallback | None = None
) -> ServeResult:
    """Serve the whole trace to completion and summarise it."""
    spec = FullAttentionSpec(
        block_size=config.block_size, num_kv_heads=1, head_size=1, dtype_bytes=1
    )
    kv_cache_config = KVCacheConfig(config.num_blocks + 1, (KVCacheGroupSpec(("layer",), spec),))
    manager = KVCacheManager(
        kv_cache_config,
        config.max_model_len,
        enable_caching=config.enable_prefix_caching,
        log_stats=True,
        watermark=config.watermark,
    )
    scheduler = Scheduler(manager, config.scheduler, POLICIES[config.policy]())
    hasher = make_request_block_hasher(config.block_size, config.hash_algorithm)
    cost_model = config.cost_model
    requests = trace.requests
    arrivals = [request.arrival_time_s * config.time_scale for request in requests]
    max_model_len = scheduler.max_model_len
    result = ServeResult(summary={})
    timings: dict[str, _Timing] = {}
    ttfts: list[float] = []
    tpots: list[float] = []
    latencies: list[float] = []
    totals = dict.fromkeys(
        (
            "prefill_tokens",
            "decode_tokens",
            "preemptions",
            "completed",
            "rejected",
            "output_tokens",
            "prompt_tokens",
            "steps",
        ),
        0,
    )
    preempted_ids: set[str] = set()
    area = {"usage": 0.0, "running": 0.0, "waiting": 0.0}
    peak = {"usage": 0.0, "running": 0, "waiting": 0}
    start_s = now = arrivals[0] if arrivals else 0.0
    next_index = 0
    num_requests = len(requests)
    while next_index < num_requests or scheduler.has_unfinished_requests():
        while next_index < num_requests and arrivals[next_index] <= now:
            trace_request = requests[next_index]
            next_index += 1
            if trace_request.num_prompt_tokens >= max_model_len:
                totals["rejected"] += 1  # as a server would: the prompt leaves no room
                continue
            request = Request(
                trace_request.request_id,
                trace_request.prompt_token_ids(),
                max_tokens=trace_request.num_output_tokens,
                block_hasher=hasher if config.enable_prefix_caching else None,
                priority=trace_request.priority,
                arrival_time=arrivals[next_index - 1],
            )
            scheduler.add_request(request)
            timings[request.request_id] = _Timing(trace_request, arrivals[next_index - 1])
        if not scheduler.has_unfinished_requests():
            if next_index < num_requests:
                now = arrivals[next_index]  # idle until the next arrival
            if progress is not None:
                progress(totals["completed"] + totals["rejected"])
            continue
        output = scheduler.schedule()
        record = scheduler.step_records[-1]
        if not output.scheduled:
            raise InvariantViolation(f"step {output.step_index} scheduled nothing")
        duration = cost_model.step_time_s(record)
        result.step_start_s.append(now)
        result.step_usage.append(record.usage)
        result.step_num_running.append(record.num_running)
        result.step_num_waiting.append(record.num_waiting)
        area["usage"] += record.usage * duration
        area["running"] += record.num_running * duration
        area["waiting"] += record.num_waiting * duration
        peak["usage"] = max(peak["usage"], record.usage)
        peak["running"] = max(peak["running"], record.num_running)
        peak["waiting"] = max(peak["waiting"], record.num_waiting)
        totals["prefill_tokens"] += record.num_prefill_tokens
        totals["decode_tokens"] += record.num_decode_tokens
        totals["preemptions"] += len(record.preempted_request_ids)
        totals["steps"] += 1
        preempted_ids.update(record.preempted_request_ids)
        now += duration
        sampled: dict[str, list[int]] = {}
        for item in output.scheduled:
            if item.is_prefill_chunk_complete:
                request = item.request
                timing = timings[request.request_id]
                if timing.first_token_s is None:
                    timing.first_token_s = now
                sampled[request.request_id] = [
                    timing.trace_request.output_token_start + request.num_output_tokens
                ]
        finished = scheduler.update_from_output(output, sampled)
        scheduler.step_records.clear()  # keep memory flat on long runs
        for request in finished:
            timing = timings.pop(request.request_id)
            first_token_s = timing.first_token_s
            assert first_token_s is not None  # a finished request has sampled a token
            num_output = request.num_output_tokens
            ttfts.append(first_token_s - timing.arrival_s)
            latencies.append(now - timing.arrival_s)
            if num_output > 1:
                tpots.append((now - first_token_s) / (num_output - 1))
            totals["completed"] += 1
            totals["output_tokens"] += num_output
            totals["prompt_tokens"] += request.num_prompt_tokens
        if finished and progress is not None:
            progress(totals["completed"] + totals["rejected"])
    end_s = now
    stats = manager.make_prefix_cache_stats()
    assert stats is not None
    makespan_s = end_s - start_s
    result.summary = {
        "num_requests_completed": totals["completed"],
        "num_requests_rejected": totals["rejected"],
        "num_steps": totals["steps"],
        "simulated_time_s": _round(makespan_s),
        "ttft_s": _distribution(ttfts),
        "tpot_s": _distribution(tpots),
        "e2e_latency_s": _distribution(latencies),
        "throughput": {
            "requests_per_s": _round(_rate(totals["completed"], makespan_s)),
            "prompt_tokens_per_s": _round(_rate(totals["prompt_tokens"], makespan_s)),
            "output_tokens_per_s": _round(_rate(totals["output_tokens"], makespan_s)),
        },
        "tokens": {
            "prompt": totals["prompt_tokens"],
            "output": totals["output_tokens"],
            "prefill_computed": totals["prefill_tokens"],
            "decode_computed": totals["decode_tokens"],
        },
        "prefix_cache": {
            "queries": stats.queries,
            "hits": stats.hits,
            "hit_rate": _round(stats.hits / stats.queries if stats.queries else 0.0),
            "preempted_queries": stats.preempted_queries,
            "preempted_hits": stats.preempted_hits,
        },
        "preemptions": {
            "num_preemptions": totals["preemptions"],
            "num_requests_preempted": len(preempted_ids),
        },
        "usage": {"peak": _round(peak["usage"]), "mean": _round(_rate(area["usage"], makespan_s))},
        "num_running": {
            "peak": peak["running"],
            "mean": _round(_rate(area["running"], makespan_s)),
        },
        "num_waiting": {
            "peak": peak["waiting"],
            "mean": _round(_rate(area["waiting"], makespan_s)),
        },
        "timeline": _timeline(result, start_s, end_s, config.num_timeline_points),
    }
    return result


def _timeline(result: ServeResult, start_s: float, end_s: float, num_points: int) -> dict:
    """The state at evenly spaced times: that of the last step started at or before each."""
    starts = result.step_start_s
    times, usage, running, waiting = [], [], [], []
    for point in range(num_points):
        time_s = start_s + (end_s - start_s) * point / max(num_points - 1, 1)
        index = bisect_right(starts, time_s) - 1
        times.append(_round(time_s))
        if index < 0:
            usage.append(0.0)
            running.append(0)
            waiting.append(0)
        else:
            usage.append(_round(result.step_usage[index]))
            running.append(result.step_num_running[index])
            waiting.append(result.step_num_waiting[index])
    return {"time_s": times, "usage": usage, "num_running": running, "num_waiting": waiting}


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Linear interpolation between closest ranks (numpy's default method)."""
    if not sorted_values:
        return 0.0
    position = (len(sorted_values) - 1) * fraction
    lower = int(position)
    upper = min(lower + 1, len(sorted_values) - 1)
    weight = position - lower
    return sorted_values[lower] * (1 - weight) + sorted_values[upper] * weight


def _distribution(values: list[float]) -> dict[str, float | int]:
    ordered = sorted(values)
    return {
        "count": len(ordered),
        "mean": _round(sum(ordered) / len(ordered) if ordered else 0.0),
        "p50": _round(percentile(ordered, 0.5)),
        "p90": _round(percentile(ordered, 0.9)),
        "p99": _round(percentile(ordered, 0.99)),
        "max": _round(ordered[-1] if ordered else 0.0),
    }


def _rate(amount: float, seconds: float) -> float:
    return amount / seconds if seconds > 0 else 0.0


def _round(value: float) -> float:
    """Six significant digits: stable, readable JSON."""
    return float(f"{value:.6g}")
