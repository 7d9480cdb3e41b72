"""Simulator layer: serve mode, time-stepped serving of a trace through the reference scheduler.

Requests arrive at their (scaled) timestamps; each step's duration comes from a cost model.
Sampled tokens are the trace's deterministic output ids. The clock is simulated: the result
depends only on the inputs, never on the machine running it.
"""

from __future__ import annotations

import heapq
from array import array
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction import ONLINE_POLICY_NAMES, EvictionConfig
from pagedkv.hashing import RequestBlockHasher, make_request_block_hasher
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from pagedkv.sched import (
    FCFSPolicy,
    PriorityPolicy,
    Scheduler,
    SchedulerConfig,
    SchedulingPolicy,
    StepRecord,
)
from pagedkv.sim.cost_model import LinearCostModel
from pagedkv.sim.inputs.block_keys import TraceBlockHasher
from pagedkv.sim.inputs.traces import Trace, TraceRequest
from pagedkv.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

ProgressCallback = Callable[[int], None]  # called with the number of requests done so far
StopCallback = Callable[[], bool]  # asked between steps: True ends the run early (Ctrl-C)
POLICIES: dict[str, Callable[[], SchedulingPolicy]] = {
    "fcfs": FCFSPolicy,
    "priority": PriorityPolicy,
}


@dataclass(frozen=True)
class ServeConfig:
    """Everything serve mode needs besides the trace.

    `num_blocks` counts usable blocks (the pool gets one more, the null block).
    `time_scale` multiplies every arrival time (0.5 replays the trace twice as fast).
    `kv_cache_config`: a real model's KV-cache groups (from `pagedkv.sizing.size_kv_cache`);
    None (the default) serves with one synthetic full-attention group of `block_size`. When set,
    its pool must hold `num_blocks + 1` blocks, requests are hashed at the manager's
    `hash_block_size` (the gcd of the group block sizes), and the manager bounds each request's
    in-flight tokens by `scheduler.max_num_batched_tokens`, as the sizing did.
    `eviction`: the pool's eviction policy (an online one); `lookahead`: the waiting-queue
    look-ahead on top of it. `host_num_blocks`: a host-memory
    tier of that many blocks (0: none); a request whose prefix continues there waits, holding
    its blocks, `host_load_s_per_token` per loaded token (the profile's PCIe link) before its
    prefill goes on, as vLLM's asynchronous KV loading does.
    Blocks are keyed by the trace's token runs (`block_keys.TraceBlockHasher`: the same hits
    as hashing, far cheaper) unless `hash_tokens` is set or KV events are on (their consumers
    need real digests): then every block's tokens are hashed with `hash_algorithm`.
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
    enable_kv_cache_events: bool = False
    kv_cache_config: KVCacheConfig | None = None
    eviction: str = "lru"
    lookahead: bool = False
    host_num_blocks: int = 0
    host_load_s_per_token: float = 0.0
    hash_tokens: bool = False

    def __post_init__(self) -> None:
        if self.eviction not in ONLINE_POLICY_NAMES:
            raise ConfigError(
                f"serve mode takes one online eviction policy ({', '.join(ONLINE_POLICY_NAMES)}), "
                f"got {self.eviction!r}"
                + (
                    ": belady needs the future, so it runs in replay mode only"
                    if self.eviction == "belady"
                    else ""
                )
            )
        if type(self.host_num_blocks) is not int or self.host_num_blocks < 0:
            raise ConfigError(f"host_num_blocks={self.host_num_blocks!r} must be an int >= 0")
        if not self.host_load_s_per_token >= 0:
            raise ConfigError(f"host_load_s_per_token={self.host_load_s_per_token!r} must be >= 0")
        if self.kv_cache_config is not None and (
            self.kv_cache_config.num_blocks != self.num_blocks + 1
        ):
            raise ConfigError(
                f"kv_cache_config holds {self.kv_cache_config.num_blocks} blocks; expected "
                f"num_blocks + 1 = {self.num_blocks + 1} (the null block included)"
            )
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown policy {self.policy!r}; choose one of {sorted(POLICIES)}")
        if not self.time_scale > 0:
            raise ConfigError(f"time_scale must be > 0, got {self.time_scale!r}")


@dataclass
class ServeResult:
    """Per-request latencies, totals and the per-step time series (for plots).

    `interrupted`: the run was stopped early; the summary covers what finished by then (and
    says so: `"interrupted": true` and `num_requests_unfinished`).
    """

    summary: dict[str, Any]
    interrupted: bool = False
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


class ServeRun:
    """One serve simulation: the clock, the scheduler and the running tallies.

    With the FCFS policy (and `defer_arrivals`), arrived requests are built and queued only
    while the scheduler has at most `max_num_seqs` waiting: it admits from the head and at
    most that many a step, so the batches are the same, and a trace that arrives far faster
    than it is served never holds every waiting prompt's tokens at once. The waiting counts
    reported include the requests not built yet.
    """

    def __init__(self, trace: Trace, config: ServeConfig, *, defer_arrivals: bool = True) -> None:
        kv_cache_config = config.kv_cache_config
        max_in_flight_tokens = None
        if kv_cache_config is None:
            spec = FullAttentionSpec(
                block_size=config.block_size, num_kv_heads=1, head_size=1, dtype_bytes=1
            )
            group = KVCacheGroupSpec(("layer",), spec)
            kv_cache_config = KVCacheConfig(config.num_blocks + 1, (group,))
        else:
            max_in_flight_tokens = config.scheduler.max_num_batched_tokens
        self.manager = KVCacheManager(
            kv_cache_config,
            config.max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=config.enable_prefix_caching,
            log_stats=True,
            enable_kv_cache_events=config.enable_kv_cache_events,
            watermark=config.watermark,
            eviction=EvictionConfig(
                policy=config.eviction,
                lookahead=config.lookahead,
                host_num_blocks=config.host_num_blocks,
                clock=self.clock,
            ),
        )
        self.scheduler = Scheduler(self.manager, config.scheduler, POLICIES[config.policy]())
        self.hasher: RequestBlockHasher | None
        self.trace_hasher: TraceBlockHasher | None = None
        hash_block_size = self.manager.hash_block_size
        if not config.enable_prefix_caching:
            self.hasher = None
        elif config.hash_tokens or config.enable_kv_cache_events:
            self.hasher = make_request_block_hasher(hash_block_size, config.hash_algorithm)
        else:
            self.hasher = self.trace_hasher = TraceBlockHasher(hash_block_size)
        self.config = config
        self.requests = trace.requests
        self.arrivals = [request.arrival_time_s * config.time_scale for request in self.requests]
        self.next_index = 0
        # Arrived (not rejected) requests not given to the scheduler yet, in arrival order.
        self.arrived: deque[tuple[TraceRequest, float]] = deque()
        self.defer_arrivals = defer_arrivals and config.policy == "fcfs"
        self.start_s = self.now = self.arrivals[0] if self.arrivals else 0.0
        self.result = ServeResult(summary={})
        self.timings: dict[str, _Timing] = {}
        self.ttfts: list[float] = []
        self.tpots: list[float] = []
        self.latencies: list[float] = []
        self.totals = dict.fromkeys(_TOTALS, 0)
        self.preempted_ids: set[str] = set()
        self.area = {"usage": 0.0, "running": 0.0, "waiting": 0.0}
        self.peak = {"usage": 0.0, "running": 0, "waiting": 0}
        # Host-tier loads in flight: (done at, request id), and their totals.
        self.kv_loads: list[tuple[float, str]] = []
        self.num_kv_loads = self.num_loaded_tokens = 0
        self.interrupted = False

    def clock(self) -> float:
        """The simulated time (the eviction policy's clock, for retention durations)."""
        return self.now

    @property
    def num_done(self) -> int:
        return self.totals["completed"] + self.totals["rejected"]

    def run(
        self, progress: ProgressCallback | None, should_stop: StopCallback | None = None
    ) -> None:
        """Serve to completion, or until `should_stop()` (then `self.interrupted` is set)."""
        scheduler = self.scheduler
        num_requests = len(self.requests)
        while self.next_index < num_requests or scheduler.has_unfinished_requests() or self.arrived:
            if should_stop is not None and should_stop():
                self.interrupted = True
                return
            self.admit_arrivals()
            if not scheduler.has_unfinished_requests() and not self.arrived:
                if self.next_index < num_requests:
                    self.now = self.arrivals[self.next_index]  # idle until the next arrival
                if progress is not None:
                    progress(self.num_done)
                continue
            self.complete_kv_loads()
            self.step()
            if progress is not None:
                progress(self.num_done)  # every step: a bar moves even before the first finish

    def complete_kv_loads(self) -> None:
        """Hand the scheduler every host-tier load done by now."""
        loads = self.kv_loads
        done = []
        while loads and loads[0][0] <= self.now:
            done.append(heapq.heappop(loads)[1])
        if done:
            self.scheduler.complete_kv_loads(done)

    def start_kv_loads(self, started: list[tuple[str, int]]) -> None:
        """Loads begin with the step that admitted them and overlap its compute."""
        for request_id, num_tokens in started:
            done_s = self.now + num_tokens * self.config.host_load_s_per_token
            heapq.heappush(self.kv_loads, (done_s, request_id))
            self.num_kv_loads += 1
            self.num_loaded_tokens += num_tokens

    def wait_for_kv_loads(self, output: Any) -> None:
        """A step that only started loads (or found nothing to run while loads are in flight):
        nothing is computed; the clock moves to the next load's end or the next arrival."""
        self.scheduler.update_from_output(output, {})
        self.scheduler.step_records.clear()
        self.start_kv_loads(output.kv_loads_started)
        if not self.kv_loads:
            raise InvariantViolation(f"step {output.step_index} scheduled nothing")
        next_s = self.kv_loads[0][0]
        if self.next_index < len(self.requests):
            next_s = min(next_s, self.arrivals[self.next_index])
        self.now = max(self.now, next_s)

    def admit_arrivals(self) -> None:
        """Add every request that has arrived by now (reject prompts with no room to answer)."""
        requests, arrivals = self.requests, self.arrivals
        max_model_len = self.scheduler.max_model_len
        while self.next_index < len(requests) and arrivals[self.next_index] <= self.now:
            trace_request = requests[self.next_index]
            arrival_s = arrivals[self.next_index]
            self.next_index += 1
            if trace_request.num_prompt_tokens >= max_model_len:
                self.totals["rejected"] += 1
            elif self.defer_arrivals:
                self.arrived.append((trace_request, arrival_s))
            else:
                request = self.make_request(trace_request, arrival_s)
                self.add_request(request, trace_request, arrival_s)

    def queue_arrived(self) -> None:
        """Build and queue arrived requests while at most `max_num_seqs` are waiting."""
        arrived = self.arrived
        waiting = self.scheduler.waiting
        max_num_seqs = self.scheduler.config.max_num_seqs
        while arrived and len(waiting) <= max_num_seqs:
            trace_request, arrival_s = arrived.popleft()
            request = self.make_request(trace_request, arrival_s)
            self.add_request(request, trace_request, arrival_s)

    def make_request(self, trace_request: TraceRequest, arrival_s: float) -> Request:
        """The request for `trace_request` (hashed, so a router can score it first)."""
        if self.trace_hasher is not None:
            self.trace_hasher.register(trace_request.request_id, trace_request)
        return Request(
            trace_request.request_id,
            trace_request.prompt_token_ids(),
            max_tokens=trace_request.num_output_tokens,
            block_hasher=self.hasher,
            priority=trace_request.priority,
            arrival_time=arrival_s,
            session_id=trace_request.session_id,
        )

    def add_request(self, request: Request, trace_request: TraceRequest, arrival_s: float) -> None:
        """Queue a request made by `make_request` (of this run or an identically configured one)."""
        self.scheduler.add_request(request)
        self.timings[request.request_id] = _Timing(trace_request, arrival_s)

    def step(self) -> int:
        """Run one scheduler step; return how many requests it finished."""
        scheduler = self.scheduler
        if self.arrived:
            self.queue_arrived()
        output = scheduler.schedule()
        record = scheduler.step_records[-1]
        if not output.scheduled:
            self.wait_for_kv_loads(output)
            return 0
        self.start_kv_loads(output.kv_loads_started)
        self.account_step(record, self.config.cost_model.step_time_s(record))
        now = self.now
        timings = self.timings
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
            self.account_finished(request)
        return len(finished)

    def account_step(self, record: StepRecord, duration_s: float) -> None:
        """Record the step's state (it holds for `duration_s`) and advance the clock."""
        result, area, peak, totals = self.result, self.area, self.peak, self.totals
        num_waiting = record.num_waiting + len(self.arrived)
        result.step_start_s.append(self.now)
        result.step_usage.append(record.usage)
        result.step_num_running.append(record.num_running)
        result.step_num_waiting.append(num_waiting)
        area["usage"] += record.usage * duration_s
        area["running"] += record.num_running * duration_s
        area["waiting"] += num_waiting * duration_s
        peak["usage"] = max(peak["usage"], record.usage)
        peak["running"] = max(peak["running"], record.num_running)
        peak["waiting"] = max(peak["waiting"], num_waiting)
        totals["prefill_tokens"] += record.num_prefill_tokens
        totals["decode_tokens"] += record.num_decode_tokens
        totals["preemptions"] += len(record.preempted_request_ids)
        totals["steps"] += 1
        self.preempted_ids.update(record.preempted_request_ids)
        self.now += duration_s

    def account_finished(self, request: Request) -> None:
        timing = self.timings.pop(request.request_id)
        if self.trace_hasher is not None:
            self.trace_hasher.forget(request.request_id)
        first_token_s = timing.first_token_s
        assert first_token_s is not None  # a finished request has sampled a token
        num_output = request.num_output_tokens
        self.ttfts.append(first_token_s - timing.arrival_s)
        self.latencies.append(self.now - timing.arrival_s)
        if num_output > 1:
            self.tpots.append((self.now - first_token_s) / (num_output - 1))
        self.totals["completed"] += 1
        self.totals["output_tokens"] += num_output
        self.totals["prompt_tokens"] += request.num_prompt_tokens

    def summary(self) -> dict[str, Any]:
        stats = self.manager.make_prefix_cache_stats()
        assert stats is not None  # the manager logs stats
        totals, area, peak = self.totals, self.area, self.peak
        makespan_s = self.now - self.start_s
        interrupted = (
            {"interrupted": True, "num_requests_unfinished": len(self.requests) - self.num_done}
            if self.interrupted
            else {}
        )
        summary = {
            **interrupted,
            "num_requests_completed": totals["completed"],
            "num_requests_rejected": totals["rejected"],
            "num_steps": totals["steps"],
            "simulated_time_s": round_sig6(makespan_s),
            "ttft_s": summarize_distribution(self.ttfts),
            "tpot_s": summarize_distribution(self.tpots),
            "e2e_latency_s": summarize_distribution(self.latencies),
            "throughput": {
                "requests_per_s": round_sig6(rate_per_s(totals["completed"], makespan_s)),
                "prompt_tokens_per_s": round_sig6(rate_per_s(totals["prompt_tokens"], makespan_s)),
                "output_tokens_per_s": round_sig6(rate_per_s(totals["output_tokens"], makespan_s)),
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
                "hit_rate": round_sig6(stats.hits / stats.queries if stats.queries else 0.0),
                "preempted_queries": stats.preempted_queries,
                "preempted_hits": stats.preempted_hits,
            },
            "preemptions": {
                "num_preemptions": totals["preemptions"],
                "num_requests_preempted": len(self.preempted_ids),
            },
            "usage": {
                "peak": round_sig6(peak["usage"]),
                "mean": round_sig6(rate_per_s(area["usage"], makespan_s)),
            },
            "num_running": {
                "peak": peak["running"],
                "mean": round_sig6(rate_per_s(area["running"], makespan_s)),
            },
            "num_waiting": {
                "peak": peak["waiting"],
                "mean": round_sig6(rate_per_s(area["waiting"], makespan_s)),
            },
            "timeline": _timeline(
                self.result, self.start_s, self.now, self.config.num_timeline_points
            ),
        }
        if self.config.host_num_blocks:
            eviction = self.manager.get_eviction_stats()
            summary["host_tier"] = {
                "num_loads": self.num_kv_loads,
                "loaded_tokens": self.num_loaded_tokens,
                "loaded_token_rate": round_sig6(
                    self.num_loaded_tokens / stats.queries if stats.queries else 0.0
                ),
                "num_demoted_blocks": eviction.num_host_demotions,
                "num_evicted_blocks": eviction.num_host_evictions,
            }
        return summary


_TOTALS = (
    "prefill_tokens",
    "decode_tokens",
    "preemptions",
    "completed",
    "rejected",
    "output_tokens",
    "prompt_tokens",
    "steps",
)


def simulate_serving(
    trace: Trace,
    config: ServeConfig,
    progress: ProgressCallback | None = None,
    should_stop: StopCallback | None = None,
) -> ServeResult:
    """Serve the whole trace to completion (or until `should_stop()`) and summarise it."""
    run = ServeRun(trace, config)
    run.run(progress, should_stop)
    run.result.summary = run.summary()
    run.result.interrupted = run.interrupted
    return run.result


def _timeline(result: ServeResult, start_s: float, end_s: float, num_points: int) -> dict:
    """The state at evenly spaced times: that of the last step started at or before each."""
    starts = result.step_start_s
    times, usage, running, waiting = [], [], [], []
    for point in range(num_points):
        time_s = start_s + (end_s - start_s) * point / max(num_points - 1, 1)
        index = bisect_right(starts, time_s) - 1
        times.append(round_sig6(time_s))
        if index < 0:
            usage.append(0.0)
            running.append(0)
            waiting.append(0)
        else:
            usage.append(round_sig6(result.step_usage[index]))
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


def summarize_distribution(values: list[float]) -> dict[str, float | int | None]:
    """Count, mean, p50, p90, p99 and max, each to six significant digits; with no values
    every statistic is None (no request finished: there is no latency to report, not 0)."""
    ordered = sorted(values)
    if not ordered:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(ordered),
        "mean": round_sig6(sum(ordered) / len(ordered) if ordered else 0.0),
        "p50": round_sig6(percentile(ordered, 0.5)),
        "p90": round_sig6(percentile(ordered, 0.9)),
        "p99": round_sig6(percentile(ordered, 0.99)),
        "max": round_sig6(ordered[-1] if ordered else 0.0),
    }


def rate_per_s(amount: float, seconds: float) -> float:
    """`amount / seconds`, 0 for an empty interval."""
    return amount / seconds if seconds > 0 else 0.0


def round_sig6(value: float) -> float:
    """Six significant digits: stable, readable JSON."""
    return float(f"{value:.6g}")
