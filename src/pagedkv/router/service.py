"""Router layer (extra `[router]`): `pagedkv router serve`, a KV-aware router over HTTP (aiohttp)
in front of engine instances, its index fed by their KV event streams. API in docs/router.md.

aiohttp: one package for the server and the client, asyncio-native, no schema layer we would
not use; every handler is a few microseconds of index work, so a thin stack keeps the latency
the index's. Handlers run on the event loop and share the router with the feed thread under
one lock (index calls are short; a Redis call is bounded by its socket timeout).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedkv.block import to_external_hash
from pagedkv.credentials import redact
from pagedkv.errors import InvalidArgumentError, MissingDependencyError, PagedKVError, install_hint
from pagedkv.hashing import make_request_block_hasher
from pagedkv.request import Request
from pagedkv.router.feeds import EventFeeds
from pagedkv.router.hash_check import BlockHashCheck
from pagedkv.router.http_schema import BodyError, ReleaseBody, RouteBody, ScoreBody, decode_body
from pagedkv.router.index import IndexUnavailableError, InMemoryPrefixIndex
from pagedkv.router.policies import ROUTING_POLICY_NAMES, make_policy
from pagedkv.router.router import NoInstanceAvailableError, Router
from pagedkv.router.service_config import ServiceConfig

try:
    from aiohttp import web
    from aiohttp.http_exceptions import HttpProcessingError
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingDependencyError(
        f"The router service needs aiohttp: {install_hint('router')}"
    ) from exc

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_SYNC_WAIT_S = 10.0
SCORE_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1)


class RouterService:
    """The router, its event feeds, the prompt hasher and the in-flight counts behind the API.

    In-flight loads: `/route` counts a request on the chosen instance unless the caller passes
    its own `loads`; `/release` (the request finished) takes it back.
    """

    def __init__(self, config: ServiceConfig, context: Any = None) -> None:
        self.config = config
        ids = [inst.instance_id for inst in config.instances]
        idempotent = {inst.instance_id for inst in config.instances if inst.idempotent}
        if config.index == "memory":
            index: Any = InMemoryPrefixIndex(idempotent_stores=idempotent)
        else:
            from pagedkv.router.redis_index import RedisPrefixIndex

            index = RedisPrefixIndex(config.index, idempotent_stores=idempotent)
        seed = None if config.tie_break == "first" else config.seed  # None: first listed
        self.router = Router(
            ids,
            make_policy(config.policy, config.max_load_gap, seed),
            index=index,
            snapshot_source=self._snapshot,
            retry_interval_s=config.retry_interval_s,
            grace_s=config.grace_s,
            hash_check=BlockHashCheck(config.hash_algorithm, config.block_size),
        )
        self.policies = {
            name: make_policy(name, config.max_load_gap, seed) for name in ROUTING_POLICY_NAMES
        }
        self.policies[config.policy] = self.router.policy
        self.feeds = EventFeeds(
            self.router, config.instances, config.replay_timeout_s, context, config.stale_after_s
        )
        self.hasher = make_request_block_hasher(config.block_size, config.hash_algorithm)
        self.tokenizer = _load_tokenizer(config.tokenizer) if config.tokenizer else None
        self.in_flight: dict[str, int] = dict.fromkeys(ids, 0)
        self.endpoints = {i.instance_id: (i.endpoint, i.replay_endpoint) for i in config.instances}
        self.num_requests = 0
        self.metrics = _Metrics(self)

    def _snapshot(self, instance_id: str) -> Any:
        return self.feeds.snapshot_source(instance_id)

    def describe(self) -> str:
        config = self.config
        num = len(config.instances)
        instances = f"{num} instance{'s' if num != 1 else ''}"
        return (
            f"pagedkv router: {instances}, index {redact(config.index)}, policy "
            f"{config.policy}; prompts hashed with {config.hash_algorithm} at block size "
            f"{config.block_size} (instances must cache with the same algorithm and block size)"
        )

    # ------------------------------------------------------------------ request handling

    def block_hashes(self, body: Mapping[str, Any]) -> list[int | bytes]:
        tokens = body.get("token_ids")
        if tokens is None and "text" in body:
            if self.tokenizer is None:
                raise BodyError("text: needs a tokenizer: start with --tokenizer DIR", "text")
            if not isinstance(body["text"], str):
                raise BodyError("text: must be a string", "text")
            tokens = self.tokenizer.encode(body["text"], add_special_tokens=True)
        if not isinstance(tokens, list):
            raise BodyError("the body needs 'token_ids' (a list of ints) or 'text'", "token_ids")
        if not tokens:
            return []
        self.num_requests += 1
        request = Request(f"r{self.num_requests}", tokens, block_hasher=self.hasher)
        # vLLM computes at least the last prompt token again (its logits start decoding), so
        # a prefix hit covers at most len - 1 tokens: a fully cached, block-aligned prompt
        # reuses one block less than it caches.
        num_blocks = (len(tokens) - 1) // self.config.block_size
        return [to_external_hash(h) for h in request.block_hashes[:num_blocks]]

    def candidates(self, body: Mapping[str, Any]) -> list[str]:
        wanted = body.get("instances")
        if wanted is None:
            return list(self.router.instance_ids)
        unknown = [i for i in wanted if i not in self.in_flight] if isinstance(wanted, list) else 0
        if not isinstance(wanted, list) or unknown or not wanted:
            raise BodyError(
                f"instances: must list known instances, got {wanted!r} (known: "
                f"{list(self.in_flight)})",
                "instances",
            )
        return wanted

    def score(self, body: Mapping[str, Any]) -> dict[str, Any]:
        hashes = self.block_hashes(body)
        ids = self.candidates(body)
        with self.feeds.lock:
            start = time.perf_counter()
            lengths = self.router.score(hashes, ids)
            elapsed = time.perf_counter() - start
            exact = self.router.exact
        self.metrics.observe_score(elapsed)
        return {
            "block_size": self.config.block_size,
            "num_blocks": len(hashes),
            "scores": {i: self._score_entry(i, n) for i, n in lengths.items()},
            "index_exact": exact,
        }

    def _score_entry(self, instance_id: str, num_blocks: int) -> dict[str, Any]:
        state = self.router.states[instance_id]
        entry: dict[str, Any] = {
            "blocks": num_blocks,
            "tokens": num_blocks * self.config.block_size,
            "connected": state.connected,
            "exact": state.exact and state.safe,
            "safe": state.safe,
        }
        if not state.safe:
            entry["excluded"] = state.misconfigured or state.down
        return entry

    def route(self, body: Mapping[str, Any]) -> dict[str, Any]:
        hashes = self.block_hashes(body)
        ids = self.candidates(body)
        name = body.get("policy", self.config.policy)
        if name not in self.policies:
            raise BodyError(
                f"policy: unknown policy {name!r}; choose one of {ROUTING_POLICY_NAMES}", "policy"
            )
        loads = body.get("loads")
        track = loads is None
        if track:
            loads = self.in_flight
        elif not isinstance(loads, dict) or not all(
            isinstance(v, int | float) for v in loads.values()
        ):
            raise BodyError("loads: must map instance ids to numbers", "loads")
        with self.feeds.lock:
            start = time.perf_counter()
            decision = self.router.route(hashes, loads, ids, policy=self.policies[name])
            elapsed = time.perf_counter() - start
            exact = self.router.exact
        self.metrics.observe_decision(decision, elapsed)
        if track:
            self.in_flight[decision.instance_id] += 1
        lengths = decision.match_lengths or {}
        chosen_state = self.router.states[decision.instance_id]
        hint = {} if chosen_state.exact else {"kv_cache_report_mode": "full"}
        return {
            **hint,
            "instance": decision.instance_id,
            "policy": decision.policy,
            "fallback": decision.fallback,
            "matched_blocks": decision.matched_blocks,
            "matched_tokens": decision.matched_blocks * self.config.block_size,
            "scores": {i: self._score_entry(i, lengths.get(i, 0)) for i in ids},
            "index_exact": exact,
            "in_flight": track,
        }

    def release(self, body: Mapping[str, Any]) -> dict[str, Any]:
        instance_id = body.get("instance")
        if instance_id not in self.in_flight:
            raise BodyError(
                f"instance: unknown instance {instance_id!r} (known: {list(self.in_flight)})",
                "instance",
            )
        self.in_flight[instance_id] = max(0, self.in_flight[instance_id] - 1)
        return {"instance": instance_id, "in_flight": self.in_flight[instance_id]}

    def health(self) -> dict[str, Any]:
        router = self.router
        with self.feeds.lock:
            instances = {
                i: {
                    "endpoint": self.endpoints[i][0],
                    "replay_endpoint": self.endpoints[i][1],
                    "connected": state.connected,
                    "down": state.down,
                    "misconfigured": state.misconfigured,
                    "exact": state.exact and state.safe,
                    "safe": state.safe,
                    "coverage": round(state.coverage, 4),
                    "restarts": self.feeds.subscribers[i].num_restarts,
                    "last_seq": self.feeds.applied_seq[i],
                    "in_flight": self.in_flight[i],
                    "batches_applied": state.num_batches_applied,
                    "snapshots": state.num_snapshots,
                    "losses": state.num_losses,
                }
                for i, state in router.states.items()
            }
            return {
                "ready": router.ready,
                "block_size": self.config.block_size,
                "hash_algorithm": self.config.hash_algorithm,
                "policy": self.config.policy,
                "index": redact(self.config.index),
                "index_available": not router.degraded,
                "index_exact": router.exact,
                "outages": router.num_outages,
                "recoveries": router.num_recoveries,
                "instances": instances,
            }

    async def wait_for_seqs(self, targets: Any) -> None:
        """Wait until the router has seen each instance's batches up to `targets[i]`."""
        if not isinstance(targets, dict) or not all(
            i in self.in_flight and isinstance(s, int) for i, s in targets.items()
        ):
            raise BodyError("sync: must map known instance ids to sequence numbers", "sync")
        deadline = time.monotonic() + MAX_SYNC_WAIT_S
        while not self.feeds.caught_up(targets):
            if time.monotonic() > deadline:
                raise InvalidArgumentError(f"timed out waiting for event batches {targets}")
            await asyncio.sleep(0.0005)


def _load_tokenizer(path: str) -> Any:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:
        raise MissingDependencyError(
            f"--tokenizer needs transformers: {install_hint('torch')}"
        ) from exc
    folder = Path(path)
    if not folder.exists():
        raise InvalidArgumentError(f"--tokenizer {path}: no such directory")
    if not folder.is_dir():
        raise InvalidArgumentError(f"--tokenizer {path}: not a directory ({_TOKENIZER_HINT})")
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise InvalidArgumentError(f"--tokenizer {path}: no tokenizer in it ({_TOKENIZER_HINT})")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - transformers raises many kinds; one line
        raise InvalidArgumentError(
            f"--tokenizer {path}: transformers cannot load the tokenizer in it "
            f"({type(exc).__name__}; {_TOKENIZER_HINT})"
        ) from None


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
_TOKENIZER_HINT = "give a local folder holding tokenizer.json or tokenizer_config.json"


class _Metrics:
    """Prometheus metrics of the service, in its own registry (extra `[metrics]`)."""

    def __init__(self, service: RouterService) -> None:
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.decisions = Counter(
            "pagedkv_router_decisions", "Routing decisions", ["policy", "fallback"],
            registry=self.registry,
        )  # fmt: skip
        self.score_latency = Histogram(
            "pagedkv_router_score_seconds", "Index scoring time per request (score or route)",
            buckets=SCORE_BUCKETS_S, registry=self.registry,
        )  # fmt: skip
        self.registry.register(_FeedCollector(service))

    def observe_score(self, seconds: float) -> None:
        self.score_latency.observe(seconds)

    def observe_decision(self, decision: Any, seconds: float) -> None:
        self.decisions.labels(decision.policy, str(decision.fallback).lower()).inc()
        if decision.match_lengths is not None:
            self.score_latency.observe(seconds)


class _FeedCollector:
    """Reads the feeds' and the router's counters at scrape time."""

    def __init__(self, service: RouterService) -> None:
        self.service = service

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        service = self.service
        router = service.router
        subscribers = service.feeds.subscribers
        counters = {
            "events_applied": ("KV events applied", lambda i: service.feeds.num_events_applied[i]),
            "gaps": ("Sequence gaps detected", lambda i: subscribers[i].num_gaps),
            "replayed_batches": ("Batches filled by replay", lambda i: subscribers[i].num_replayed),
            "snapshots": ("Snapshots applied", lambda i: router.states[i].num_snapshots),
            "lost_batches": ("Batches lost for good", lambda i: subscribers[i].num_lost),
            "publisher_restarts": ("Publisher restarts", lambda i: subscribers[i].num_restarts),
        }
        for name, (text, read) in counters.items():
            family = CounterMetricFamily(f"pagedkv_router_{name}", text, labels=["instance"])
            for instance_id in router.instance_ids:
                family.add_metric([instance_id], read(instance_id))
            yield family
        fallback = CounterMetricFamily(
            "pagedkv_router_fallback_decisions", "Decisions made without the index"
        )
        fallback.add_metric([], router.num_fallback_decisions)
        yield fallback
        exact = GaugeMetricFamily("pagedkv_router_index_exact", "1 while the index is exact")
        exact.add_metric([], float(router.exact))
        yield exact
        index = router.index
        if isinstance(index, InMemoryPrefixIndex):
            size = GaugeMetricFamily("pagedkv_router_index_hashes", "Distinct hashes indexed")
            size.add_metric([], index.num_hashes)
            yield size


class _ClientFaultFilter(logging.Filter):
    """Turns aiohttp's report of a client's fault (a dropped connection, a malformed request,
    an oversized header) into one warning line; a fault of ours keeps its traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, ConnectionError | HttpProcessingError):
            reason = exc.message if isinstance(exc, HttpProcessingError) else str(exc)
            reason = " ".join(str(reason).split())
            if len(reason) > 160:
                reason = reason[:160] + "..."
            record.msg = f"{record.getMessage()}: {type(exc).__name__}: {reason} (client fault)"
            record.args = None
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


_CLIENT_FAULT_FILTER = _ClientFaultFilter()


def quiet_client_faults() -> None:
    """Install the one-line logging of clients' faults on aiohttp's server logger (once)."""
    server_logger = logging.getLogger("aiohttp.server")
    if _CLIENT_FAULT_FILTER not in server_logger.filters:
        server_logger.addFilter(_CLIENT_FAULT_FILTER)


def make_app(service: RouterService) -> web.Application:
    """The aiohttp application: POST /score /route /release, GET /health /ready /metrics."""
    quiet_client_faults()
    app = web.Application(client_max_size=MAX_BODY_BYTES)

    def json_handler(method: Any, schema: Any) -> Any:
        async def handle(request: web.Request) -> web.Response:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                error = f"the body is over {MAX_BODY_BYTES:,} bytes"
                return web.json_response({"error": error, "field": None}, status=413)
            try:
                body = decode_body(raw, schema)  # every field's type and range, or BodyError
                if "sync" in body:
                    await service.wait_for_seqs(body["sync"])
                return web.json_response(method(body))
            except (IndexUnavailableError, NoInstanceAvailableError) as exc:
                return web.json_response({"error": str(exc)}, status=503)
            except (PagedKVError, ValueError) as exc:
                field = exc.field if isinstance(exc, BodyError) else None
                return web.json_response({"error": str(exc), "field": field}, status=400)

        return handle

    async def health(request: web.Request) -> web.Response:
        return web.json_response(service.health())

    async def ready(request: web.Request) -> web.Response:
        state = service.health()
        return web.json_response(state, status=200 if state["ready"] else 503)

    async def metrics(request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        with service.feeds.lock:
            payload = generate_latest(service.metrics.registry)
        return web.Response(body=payload, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/score", json_handler(service.score, ScoreBody))
    app.router.add_post("/route", json_handler(service.route, RouteBody))
    app.router.add_post("/release", json_handler(service.release, ReleaseBody))
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    return app


def serve(config: ServiceConfig, print_fn: Any = print) -> None:
    """Run until interrupted: start the feeds, serve HTTP on `config.host:config.port`."""
    service = RouterService(config)
    service.feeds.start()
    app = make_app(service)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, config.host, config.port)
        await site.start()
        port = runner.addresses[0][1] if runner.addresses else config.port
        print_fn(service.describe())
        print_fn(f"listening on http://{config.host}:{port}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):  # operators stop services with TERM
            loop.add_signal_handler(signum, stop.set)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    finally:
        service.feeds.close()
