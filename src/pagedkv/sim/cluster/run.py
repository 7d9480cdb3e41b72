"""Simulator layer: N serving instances behind a router (`pagedkv simulate --instances N`).

Each instance is a real KVCacheManager and Scheduler (serve mode's run) that publishes its KV
events over ZeroMQ; the router's prefix index is fed only by what its subscribers receive.
One simulated clock: arrivals and instance steps are processed in time order, and a step's
events become visible to the router when the step ends. pyzmq and msgspec (extra `[events]`)
are imported when a run starts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from pagedkv.block import to_external_hash
from pagedkv.credentials import redact
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.router import (
    ROUTING_POLICY_NAMES,
    IndexUnavailableError,
    Router,
    external_events,
    make_policy,
    request_block_hashes,
)
from pagedkv.sim.cluster.audit import RoutingAudit
from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.serve import (
    ServeConfig,
    ServeRun,
    rate_per_s,
    round_sig6,
    summarize_distribution,
)

ProgressCallback = Callable[[int], None]
StopCallback = Callable[[], bool]  # asked between events: True ends the run early (Ctrl-C)
EVENT_TRANSPORTS = ("inproc", "tcp")
_BARRIER_TIMEOUT_S = 30.0
_FILL_AFTER_S = 0.5  # nothing received this long while behind: ask the replay socket
_AUDIT_CONTENTS_EVERY = 25  # decisions between two whole-index comparisons (and after a recovery)


@dataclass(frozen=True)
class ClusterConfig:
    """`serve` configures every instance alike (its `num_blocks` is per instance)."""

    serve: ServeConfig
    num_instances: int
    event_transport: str = "inproc"
    residency_sample_rate: float = 0.01
    max_load_gap: float | None = 4.0
    """prefix-aware only: candidates are within this many unfinished requests of the least
    loaded instance (None: pure prefix scoring, which piles a shared system prompt's whole
    workload onto one instance)."""
    index_url: str | None = None
    """None: the router's index in memory; `redis://HOST:PORT[/DB]`: in that Redis (extra
    `[router]`), one fresh namespace per run, resynchronised from the instances' snapshots
    after an outage."""
    index_retry_interval_s: float = 0.5
    """How often a router whose index is down tries it again (wall-clock seconds)."""
    router_url: str | None = None
    """Route through this running `pagedkv router serve` (http://HOST:PORT) instead of an
    in-process router: the instances publish on the endpoints it subscribes to."""
    audit_index: bool = False
    """Check every routing decision made on the index against an index fed directly by the
    publishers (the truth as of the batches published): counts phantom hits (a score above
    the truth) and inexact decisions. Costs one more index; for tests."""

    def __post_init__(self) -> None:
        if not isinstance(self.num_instances, int) or self.num_instances < 1:
            raise ConfigError(f"num_instances must be an int >= 1, got {self.num_instances!r}")
        if self.event_transport not in EVENT_TRANSPORTS:
            raise ConfigError(
                f"event_transport must be one of {EVENT_TRANSPORTS}, got {self.event_transport!r}"
            )
        if self.router_url is not None and self.index_url is not None:
            raise ConfigError("router_url and index_url exclude each other (the service has one)")
        if self.index_url is not None and not self.index_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ConfigError(
                f"index_url must be redis://HOST:PORT[/DB] (or rediss://, unix://), got "
                f"{redact(repr(self.index_url))}"
            )


class _Instance:
    """One serving instance: its run, its publisher, and the router's subscriber to it."""

    def __init__(
        self,
        instance_id: str,
        run: ServeRun,
        transport: str,
        run_tag: str,
        endpoints: tuple[str, str] | None = None,
    ) -> None:
        from pagedkv.wire.transport import ZmqEventPublisher, ZmqEventSubscriber

        self.instance_id = instance_id
        self.run = run
        self.subscriber: Any = None
        replay: str | None
        if endpoints is not None:  # a router service subscribes to these
            self.publisher = ZmqEventPublisher(endpoints[0], endpoints[1], bind=True)
        elif transport == "inproc":
            name = f"inproc://pagedkv-sim-{run_tag}-{instance_id}"
            self.publisher = ZmqEventPublisher(name, name + "-replay")
            endpoint, replay = name, name + "-replay"
        else:
            self.publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            endpoint, replay = self.publisher.endpoint, self.publisher.replay_endpoint
        if endpoints is None:
            self.subscriber = ZmqEventSubscriber(endpoint, replay, replay_timeout_s=5.0)
        self.pending: list[tuple[float, list]] = []  # (visible at, events) not yet published
        self.num_dispatched = 0
        self.busy_s = 0.0
        self.num_events = 0
        self.seen_preemptions = 0
        self.seen_queries = 0
        self.seen_hits = 0

    @property
    def busy(self) -> bool:
        return self.run.scheduler.has_unfinished_requests()

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
        self.publisher.shutdown()


class _ClusterRun:
    """One policy over the whole trace."""

    def __init__(
        self, trace: Trace, config: ClusterConfig, policy: str, metrics: Any, engine_prefix: str
    ) -> None:
        serve = replace(config.serve, enable_kv_cache_events=True)
        empty = Trace(trace.name, (), trace.source)
        tag = uuid.uuid4().hex[:8]
        self.remote = self._connect_remote(config, serve)
        self.instances = [
            _Instance(
                str(i),
                ServeRun(empty, serve),
                config.event_transport,
                tag,
                None if self.remote is None else self.remote.endpoints[i],
            )
            for i in range(config.num_instances)
        ]
        if self.remote is not None:
            self.remote.wait_for_fresh_streams()
        self.policy = policy
        self.router: Any = self.remote or Router(
            [inst.instance_id for inst in self.instances],
            make_policy(policy, config.max_load_gap),
            index=self._make_index(config.index_url, tag),
            snapshot_source=self._snapshot,
            retry_interval_s=config.index_retry_interval_s,
        )
        self.audit = RoutingAudit() if config.audit_index else None
        self.trace = trace
        self.serve = serve
        self.arrivals = [r.arrival_time_s * serve.time_scale for r in trace.requests]
        self.start_s = self.arrivals[0] if self.arrivals else 0.0
        for inst in self.instances:
            inst.run.now = inst.run.start_s = self.start_s
        self.metrics = metrics
        self.engine_prefix = engine_prefix
        self.collectors: dict[str, Any] = {}
        if metrics is not None:
            self._attach_collectors(config.residency_sample_rate)
        self.index_url = config.index_url
        self.num_rejected = 0
        self.interrupted = False
        self.matched_blocks: list[int] = []
        self.hash_block_size = serve.block_size

    @staticmethod
    def _connect_remote(config: ClusterConfig, serve: ServeConfig) -> Any:
        if config.router_url is None:
            return None
        from pagedkv.sim.cluster.remote_router import RemoteRouter

        return RemoteRouter(
            config.router_url, config.num_instances, serve.block_size, serve.hash_algorithm
        )

    def _make_index(self, url: str | None, tag: str) -> Any:
        if url is None:
            return None
        from pagedkv.router.redis_index import RedisPrefixIndex

        return RedisPrefixIndex(url, namespace=f"pagedkv-sim-{tag}")

    def _snapshot(self, instance_id: str) -> Any:
        return self.instances[int(instance_id)].subscriber.sync_batch()

    def _attach_collectors(self, sample_rate: float) -> None:
        from pagedkv.metrics.residency import KVCacheMetricsCollector

        for inst in self.instances:
            run = inst.run
            # The simulated clock, so residency is in simulated seconds.
            collector = KVCacheMetricsCollector(sample_rate, clock=_simulated_clock_ns(run))
            # The pool reads its collector on every call, so attaching it now is enough.
            run.manager.block_pool.metrics_collector = collector
            self.collectors[inst.instance_id] = collector

    # ------------------------------------------------------------------ the loop

    def run(self, progress: ProgressCallback | None, should_stop: StopCallback | None) -> None:
        """Serve the trace, or until `should_stop()`; either way the router then sees every
        event published, so the index comparison stays meaningful."""
        requests = self.trace.requests
        next_index = 0
        try:
            while True:
                if should_stop is not None and should_stop():
                    self.interrupted = True
                    break
                busy = [inst for inst in self.instances if inst.busy]
                next_step = min(busy, key=lambda inst: inst.run.now) if busy else None
                arrival_s = self.arrivals[next_index] if next_index < len(requests) else None
                if next_step is None or (arrival_s is not None and arrival_s <= next_step.run.now):
                    if arrival_s is None:  # nothing busy, nothing left to arrive
                        break
                    self._publish_visible(arrival_s)
                    self._dispatch(requests[next_index], arrival_s)
                    next_index += 1
                else:
                    self._step(next_step)
                if progress is not None:
                    progress(self.num_done)
            self._publish_visible(float("inf"))
            self._barrier()
            self.router.maybe_recover(force=True)  # the summary reads the index
        finally:
            for inst in self.instances:
                inst.close()

    @property
    def num_done(self) -> int:
        return self.num_rejected + sum(inst.run.totals["completed"] for inst in self.instances)

    def _dispatch(self, trace_request: Any, arrival_s: float) -> None:
        first = self.instances[0].run
        if trace_request.num_prompt_tokens >= first.scheduler.max_model_len:
            self.num_rejected += 1
            return
        request = first.make_request(trace_request, arrival_s)
        self._barrier()  # the router sees every event published so far, no more
        loads = {inst.instance_id: inst.run.scheduler.get_num_unfinished_requests()
                 for inst in self.instances}  # fmt: skip
        block_hashes = request_block_hashes(request)
        if self.remote is not None:
            published = [inst.publisher.next_seq - 1 for inst in self.instances]
            decision = self.remote.route_request(
                request.prompt_token_ids, loads, published, self.policy
            )
        else:
            decision = self.router.route(block_hashes, loads)
        if self.audit is not None and decision.match_lengths is not None:
            self.audit.check(block_hashes, decision.match_lengths)
            recovered = self.router.num_recoveries != self.audit.seen_recoveries
            if recovered or self.audit.num_decisions % _AUDIT_CONTENTS_EVERY == 0:
                self.audit.seen_recoveries = self.router.num_recoveries
                self.audit.check_contents(self.router.index, self.instances)
        self.matched_blocks.append(decision.matched_blocks)
        inst = self.instances[int(decision.instance_id)]
        if not inst.busy:
            inst.run.now = max(inst.run.now, arrival_s)  # idle until this arrival
        inst.run.add_request(request, trace_request, arrival_s)
        inst.num_dispatched += 1

    def _step(self, inst: _Instance) -> None:
        run = inst.run
        start_s = run.now
        run.step()
        inst.busy_s += run.now - start_s
        events = run.manager.take_events()
        if events:
            inst.pending.append((run.now, events))  # visible when the step ends
            inst.num_events += len(events)
        if self.metrics is not None:
            self._observe(inst)

    def _publish_visible(self, now_s: float) -> None:
        from pagedkv.wire import EventBatch

        for inst in self.instances:
            pending = inst.pending
            count = 0
            while count < len(pending) and pending[count][0] <= now_s:
                visible_s, events = pending[count]
                inst.publisher.publish(EventBatch(visible_s, events))
                if self.audit is not None:
                    self.audit.truth.apply_events(inst.instance_id, external_events(events))
                count += 1
            del pending[:count]

    def _barrier(self) -> None:
        """Apply, through the subscribers, every batch published so far (a router service
        does it itself: each request's `sync`)."""
        if self.remote is not None:
            return
        deadline = time.monotonic() + _BARRIER_TIMEOUT_S
        router = self.router
        for inst in self.instances:
            last_published = inst.publisher.next_seq - 1
            subscriber = inst.subscriber
            while last_published >= 0 and (
                subscriber.last_seq is None or subscriber.last_seq < last_published
            ):
                if time.monotonic() > deadline:
                    raise InvariantViolation(
                        f"instance {inst.instance_id}: events up to {last_published} were "
                        f"published but the router got {subscriber.last_seq}"
                    )
                num_lost = subscriber.num_lost
                items = subscriber.poll(0.01)
                if not items and time.monotonic() > deadline - _BARRIER_TIMEOUT_S + _FILL_AFTER_S:
                    # Over tcp the first batches can go out before the subscription arrives
                    # (ZeroMQ's slow joiner), and nothing later reveals the gap.
                    items = subscriber.fill_to(last_published + 1)
                for item in items:
                    # Sequence-aware: a batch that a snapshot applied meanwhile (a recovery
                    # inside this loop) already contains is skipped, never applied twice.
                    router.apply_batch(inst.instance_id, item.seq, item.batch)
                if subscriber.num_lost != num_lost:
                    router.mark_lost(inst.instance_id)
        router.maybe_recover()

    def _observe(self, inst: _Instance) -> None:
        run = inst.run
        stats = run.manager.prefix_cache_stats
        delta = None
        if stats is not None:
            from pagedkv.stats import PrefixCacheStats

            delta = PrefixCacheStats(
                queries=stats.queries - inst.seen_queries, hits=stats.hits - inst.seen_hits
            )
            inst.seen_queries, inst.seen_hits = stats.queries, stats.hits
        preemptions = run.totals["preemptions"]
        collector = self.collectors[inst.instance_id]
        allocated, evicted = collector.take_block_counts()
        self.metrics.observe(
            engine=self.engine_prefix + inst.instance_id,
            usage=run.result.step_usage[-1],
            prefix_cache_stats=delta,
            residency_events=collector.drain_events(),
            num_preemptions=preemptions - inst.seen_preemptions,
            num_blocks_allocated=allocated,
            num_blocks_evicted=evicted,
        )
        inst.seen_preemptions = preemptions

    # ------------------------------------------------------------------ the report

    def index_matches_pools(self) -> bool | None:
        """Whether the router's index equals every instance's real cache contents (None: the
        index cannot be read)."""
        if self.remote is not None or self.router.degraded:
            return None
        try:
            return self._index_equals_pools()
        except IndexUnavailableError:
            return None

    def _index_equals_pools(self) -> bool:
        for inst in self.instances:
            pool = inst.run.manager.block_pool
            actual: dict = {}
            for block_hash, block_ids in pool.cached_hashes(0).items():
                key = (pool.medium, 0, to_external_hash(block_hash))
                actual[key] = actual.get(key, 0) + len(block_ids)
            if self.router.index.instance_contents(inst.instance_id) != actual:
                return False
        return True

    def summary(self, policy: str) -> dict[str, Any]:
        runs = [inst.run for inst in self.instances]
        ttfts = [value for run in runs for value in run.ttfts]
        latencies = [value for run in runs for value in run.latencies]
        end_s = max(run.now for run in runs)
        makespan_s = end_s - self.start_s
        index_ok = self.index_matches_pools()
        per_instance = []
        queries = hits = 0
        for inst in self.instances:
            stats = inst.run.manager.make_prefix_cache_stats()
            if stats is None:
                raise InvariantViolation(f"instance {inst.instance_id} was built without log_stats")
            queries += stats.queries
            hits += stats.hits
            per_instance.append(
                {
                    "instance": inst.instance_id,
                    "requests": inst.num_dispatched,
                    "completed": inst.run.totals["completed"],
                    "prefill_tokens_computed": inst.run.totals["prefill_tokens"],
                    "busy_s": round_sig6(inst.busy_s),
                    "hit_rate": round_sig6(stats.hits / stats.queries if stats.queries else 0.0),
                    "preemptions": inst.run.totals["preemptions"],
                    "event_batches": inst.publisher.next_seq,
                    "events": inst.num_events,
                    "events_dropped": inst.publisher.dropped_batches,
                    "subscriber": _subscriber_counts(inst.subscriber),
                }
            )
        completed = sum(run.totals["completed"] for run in runs)
        output_tokens = sum(run.totals["output_tokens"] for run in runs)
        interrupted = (
            {
                "interrupted": True,
                "num_requests_unfinished": len(self.trace.requests) - self.num_done,
            }
            if self.interrupted
            else {}
        )
        return {
            "router": policy,
            **interrupted,
            "num_requests_completed": completed,
            "num_requests_rejected": self.num_rejected,
            "simulated_time_s": round_sig6(makespan_s),
            "prefix_cache": {
                "queries": queries,
                "hits": hits,
                "hit_rate": round_sig6(hits / queries if queries else 0.0),
            },
            "ttft_s": summarize_distribution(ttfts),
            "e2e_latency_s": summarize_distribution(latencies),
            "throughput": {
                "requests_per_s": round_sig6(rate_per_s(completed, makespan_s)),
                "output_tokens_per_s": round_sig6(rate_per_s(output_tokens, makespan_s)),
            },
            "load_balance": _load_balance(per_instance),
            "routing": self._routing_summary(index_ok),
            "instances": per_instance,
        }

    def _routing_summary(self, index_ok: bool | None) -> dict[str, Any]:
        router = self.router
        matched = self.matched_blocks
        out: dict[str, Any] = {
            "mean_matched_blocks": round_sig6(sum(matched) / len(matched) if matched else 0.0),
            "fallback_decisions": router.num_fallback_decisions,
            "index_matches_pools": index_ok,
            "index": "service" if self.remote else "redis" if self.index_url else "memory",
            **({} if self.remote is None else self.remote.describe()),
            "index_available": not router.degraded,
            "index_exact": router.exact,
            "index_outages": router.num_outages,
            "index_recoveries": router.num_recoveries,
            "dropped_event_batches": router.num_dropped_event_batches,
        }
        if self.audit is not None:
            out["audit"] = self.audit.summary()
        return out

    def close(self) -> None:
        """Drop this run's Redis namespace, if the server is reachable."""
        if self.remote is not None:
            self.remote.close()
            return
        drop = getattr(self.router.index, "drop_namespace", None)
        if drop is not None:
            try:
                drop()
            except IndexUnavailableError:
                pass


def _simulated_clock_ns(run: ServeRun) -> Callable[[], int]:
    """A clock reading `run`'s simulated time, in nanoseconds."""
    return lambda: int(run.now * 1e9)


def _subscriber_counts(subscriber: Any) -> dict[str, int] | None:
    """The in-process subscriber's counters (None: a router service subscribed instead)."""
    if subscriber is None:
        return None
    return {
        "gaps": subscriber.num_gaps,
        "replayed": subscriber.num_replayed,
        "snapshots": subscriber.num_snapshots,
        "missed": subscriber.num_missed,
        "malformed": subscriber.num_malformed,
    }


def _load_balance(per_instance: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Spread of work across instances: max over mean (1 = perfectly even)."""

    def max_over_mean(values: Sequence[float]) -> float:
        mean = sum(values) / len(values)
        return round_sig6(max(values) / mean if mean else 1.0)

    requests = [item["requests"] for item in per_instance]
    prefill = [item["prefill_tokens_computed"] for item in per_instance]
    busy = [item["busy_s"] for item in per_instance]
    return {
        "requests_per_instance": requests,
        "requests_max_over_mean": max_over_mean(requests),
        "prefill_tokens_max_over_mean": max_over_mean(prefill),
        "busy_time_max_over_mean": max_over_mean(busy),
    }


def simulate_cluster(
    trace: Trace,
    config: ClusterConfig,
    policies: Sequence[str],
    metrics: Any = None,
    progress: ProgressCallback | None = None,
    should_stop: StopCallback | None = None,
) -> list[dict[str, Any]]:
    """Serve the trace once per routing policy (fresh instances each time); one summary each.

    Once `should_stop()` says so, the current policy's run ends (its summary is marked
    `"interrupted": true`) and the policies after it are not run.

    With `metrics` (a `pagedkv.metrics.KVCacheMetrics`), every instance step is observed,
    labelled `engine="<i>"` (or `"<policy>/<i>"` when several policies run).
    """
    for policy in policies:
        if policy not in ROUTING_POLICY_NAMES:
            raise ConfigError(f"unknown router {policy!r}; choose one of {ROUTING_POLICY_NAMES}")
    summaries = []
    for policy in policies:
        prefix = f"{policy}/" if len(policies) > 1 else ""
        run = _ClusterRun(trace, config, policy, metrics, prefix)
        try:
            run.run(progress, should_stop)
            summaries.append(run.summary(policy))
        finally:
            run.close()
        if run.interrupted:
            break
    return summaries
