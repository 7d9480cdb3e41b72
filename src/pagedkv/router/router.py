"""Router layer: dispatch requests across instances with a policy over an event-fed prefix
index, falling back to a load-only policy while the index backend is down."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from pagedkv.block import to_external_hash
from pagedkv.errors import InvalidArgumentError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.hashing import resolve_block_hashes
from pagedkv.request import Request
from pagedkv.router.index import (
    IndexUnavailableError,
    InMemoryPrefixIndex,
    PrefixIndex,
    check_instance_id,
)
from pagedkv.router.policies import LeastLoadedPolicy, RoutingPolicy, make_policy

logger = logging.getLogger(__name__)

SnapshotSource = Callable[[str], Iterable[KVCacheEvent] | None]
"""instance id -> events rebuilding its cache contents (a snapshot batch's events), or None."""


def request_block_hashes(
    request: Request, block_size: int | None = None, hash_format: str = "int64"
) -> list[Hashable]:
    """The request's block hashes as the instances' events carry them: at `block_size` (the
    group's, default the request's hash block size) and in the wire's hash format."""
    hashes = request.block_hashes
    hasher = request.block_hasher
    if block_size is not None and hasher is not None:
        hashes = resolve_block_hashes(hashes, hasher.hash_block_size, block_size)
    use_int = hash_format == "int64"
    return [to_external_hash(h, use_int) for h in hashes]


def _external_events(events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
    """In-process events (digest hashes) in the int64 form of the wire; others unchanged."""
    out: list[KVCacheEvent] = []
    for event in events:
        kind = type(event)
        if kind is BlockStored or kind is BlockRemoved:
            hashes = event.block_hashes
            if hashes and type(hashes[0]) is bytes:
                event = replace(event, block_hashes=[to_external_hash(h) for h in hashes])
                parent = getattr(event, "parent_block_hash", None)
                if type(parent) is bytes:
                    event = replace(event, parent_block_hash=to_external_hash(parent))
        out.append(event)
    return out


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    instance_id: str
    policy: str
    """The policy that decided: the fallback's name when the index was unavailable."""
    matched_blocks: int
    """Blocks of the request the chosen instance caches, per the index (0 if not consulted)."""
    fallback: bool


class Router:
    """Routes requests to instances; its index learns only from the instances' events.

    Hashes: with `hash_format="int64"` (default, the wire's default) digest hashes, from
    in-process events or requests, are reduced to their low 64 bits on the way in, so events
    taken straight from a manager and events decoded from the wire index alike. With
    "bytes", hashes are used as given (publish with `hash_format="bytes"`).

    Outage contract: when the index raises `IndexUnavailableError` (Redis down), the router
    logs one warning, routes with `fallback` (least-loaded by default) and drops incoming
    events. Every `retry_interval_s` it pings the index; once it answers, every instance is
    resynchronised from `snapshot_source` (or cleared, without one: an empty index never
    claims a hit that is not there), and prefix-aware routing resumes.
    """

    def __init__(
        self,
        instance_ids: Sequence[str],
        policy: RoutingPolicy | str = "prefix-aware",
        *,
        index: PrefixIndex | None = None,
        fallback: RoutingPolicy | None = None,
        snapshot_source: SnapshotSource | None = None,
        retry_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        hash_format: str = "int64",
    ) -> None:
        if hash_format not in ("int64", "bytes"):
            raise InvalidArgumentError(
                f"hash_format must be 'int64' or 'bytes', got {hash_format!r}"
            )
        ids = [check_instance_id(i) for i in instance_ids]
        if not ids or len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"instance ids must be non-empty and unique, got {ids}")
        self.instance_ids = ids
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.index: PrefixIndex = index if index is not None else InMemoryPrefixIndex()
        self.fallback = fallback or LeastLoadedPolicy()
        if self.fallback.uses_index:
            raise InvalidArgumentError("the fallback policy must not need the index")
        self.snapshot_source = snapshot_source
        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self._use_int = hash_format == "int64"
        self.degraded = False
        self._last_attempt = 0.0
        self.num_outages = 0
        self.num_recoveries = 0
        self.num_fallback_decisions = 0
        self.num_dropped_event_batches = 0

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> bool:
        """Feed one instance's events to the index; False if dropped (index unavailable)."""
        if instance_id not in self.instance_ids:
            raise InvalidArgumentError(f"unknown instance {instance_id!r}")
        if self.degraded:
            self._maybe_recover()
        if not self.degraded:
            if self._use_int:
                events = _external_events(events)
            try:
                self.index.apply_events(instance_id, events)
                return True
            except IndexUnavailableError as exc:
                self._enter_outage(exc)
        self.num_dropped_event_batches += 1
        return False

    def route(
        self, block_hashes: Sequence[Hashable], loads: Mapping[str, float]
    ) -> RoutingDecision:
        """Pick an instance for a request with these (external) block hashes."""
        policy = self.policy
        ids = self.instance_ids
        if not policy.uses_index:
            return RoutingDecision(policy.choose(ids, loads, None), policy.name, 0, False)
        if self.degraded:
            self._maybe_recover()
        if not self.degraded:
            if self._use_int and block_hashes and type(block_hashes[0]) is bytes:
                block_hashes = [to_external_hash(h) for h in block_hashes]
            try:
                lengths = self.index.match_lengths(block_hashes, ids)
            except IndexUnavailableError as exc:
                self._enter_outage(exc)
            else:
                chosen = policy.choose(ids, loads, lengths)
                return RoutingDecision(chosen, policy.name, lengths[chosen], False)
        self.num_fallback_decisions += 1
        chosen = self.fallback.choose(ids, loads, None)
        return RoutingDecision(chosen, self.fallback.name, 0, True)

    def _enter_outage(self, exc: Exception) -> None:
        self._last_attempt = self.clock()
        if self.degraded:
            return
        self.degraded = True
        self.num_outages += 1
        logger.warning(
            "prefix index unavailable (%s): routing falls back to %s until it recovers",
            exc,
            self.fallback.name,
        )

    def _maybe_recover(self) -> None:
        now = self.clock()
        if now - self._last_attempt < self.retry_interval_s:
            return
        self._last_attempt = now
        try:
            self.index.ping()
            for instance_id in self.instance_ids:
                events = self.snapshot_source(instance_id) if self.snapshot_source else None
                if events is None:
                    events = [AllBlocksCleared()]
                elif self._use_int:
                    events = _external_events(events)
                self.index.apply_events(instance_id, events)
        except IndexUnavailableError:
            return
        self.degraded = False
        self.num_recoveries += 1
        logger.warning(
            "prefix index recovered: %d instances resynchronised%s; prefix-aware routing resumes",
            len(self.instance_ids),
            " from snapshots" if self.snapshot_source else " (cleared: no snapshot source)",
        )
