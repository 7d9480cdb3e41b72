"""Router layer: dispatch requests across instances with a policy over an event-fed prefix
index, knowing per instance whether the index is exact, and falling back to a load-only
policy while the index cannot be read."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

from pagedkv.block import BlockHash, to_external_hash
from pagedkv.errors import InvalidArgumentError, PagedKVError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedkv.hashing import resolve_block_hashes
from pagedkv.request import Request
from pagedkv.router.hash_check import BlockHashCheck
from pagedkv.router.index import (
    IndexUnavailableError,
    InMemoryPrefixIndex,
    PrefixIndex,
    check_instance_id,
)
from pagedkv.router.policies import LeastLoadedPolicy, RoutingPolicy, make_policy
from pagedkv.wire.codec import EventBatch

logger = logging.getLogger(__name__)

SnapshotSource = Callable[[str], EventBatch | Iterable[KVCacheEvent] | None]
"""instance id -> what rebuilds its cache contents, or None when nothing can. Best: a snapshot
`EventBatch` (`ZmqEventSubscriber.sync_batch`), whose `snapshot_next_seq` tells which stream
batches it already contains; a bare event list (`CacheMirror.snapshot_events()`) is trusted to
be current and to overlap no batch fed later."""


def request_block_hashes(
    request: Request, block_size: int | None = None, hash_format: str = "int64"
) -> list[Hashable]:
    """The request's block hashes as the instances' events carry them: at `block_size` (the
    group's, default the request's hash block size) and in the wire's hash format."""
    hashes: Sequence[BlockHash] = request.block_hashes
    hasher = request.block_hasher
    if block_size is not None and hasher is not None:
        hashes = resolve_block_hashes(hashes, hasher.hash_block_size, block_size)
    use_int = hash_format == "int64"
    return [to_external_hash(h, use_int) for h in hashes]


def external_events(events: Iterable[KVCacheEvent]) -> list[KVCacheEvent]:
    """In-process events (digest hashes) in the int64 form of the wire; others unchanged."""
    out: list[KVCacheEvent] = []
    stream: Iterable[Any] = events  # narrowed by `type(...) is`, which mypy cannot follow
    for event in stream:
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


NOT_CONNECTED_YET = "not connected yet"
"""Down reason at start: `ready` waits for the instance (until it is declared down)."""
NEVER_CONNECTED = "never connected"


class NoInstanceAvailableError(PagedKVError):
    """No candidate instance can take a request now (every one is down, restarting or
    misconfigured)."""


@dataclass(frozen=True, slots=True)
class RoutingDecision:
    instance_id: str
    policy: str
    """The policy that decided: the fallback's name when the index was unavailable."""
    matched_blocks: int
    """Blocks of the request the chosen instance caches, per the index (0 if not consulted)."""
    fallback: bool
    match_lengths: Mapping[str, int] | None = None
    """Every candidate's score, when the index was consulted."""


@dataclass(slots=True)
class InstanceState:
    """What the router knows about one instance's entries in the index.

    `exact`: they equal the instance's cache as of the last batch applied. When False (events
    were lost for good, or an outage was recovered without a snapshot) they are a subset of
    it: the router cleared them, so it may miss hits there but never claims one that is not
    ("exact from now": every entry is real, some cached blocks have none).

    `down`: why the instance's feed is not trusted now (disconnected, restarting, its health
    check failing, never connected), None while it is live. A down instance scores 0 and is
    never routed to; its entries are kept for the router's grace period and count again only
    if its stream resumes without a restart, else they are cleared first.

    `misconfigured`: why its hashes cannot be the router's (block size, algorithm, seed);
    never scored while set. `safe` (no phantom hit possible): live and not misconfigured.
    """

    exact: bool = True
    connected: bool = True
    next_seq: int | None = None
    """Stream batches numbered below this are contained in the last snapshot applied."""
    num_batches_applied: int = 0
    num_batches_skipped: int = 0
    num_snapshots: int = 0
    num_losses: int = 0
    down: str | None = None
    down_since: float | None = None
    ever_live: bool = True
    misconfigured: str | None = None
    num_restarts: int = 0
    num_removals_since_loss: int = 0
    num_unknown_removals_since_loss: int = 0
    entries_dropped: bool = False
    """The grace period ran out while down: its entries were cleared."""

    @property
    def safe(self) -> bool:
        return self.down is None and self.misconfigured is None

    @property
    def coverage(self) -> float:
        """Estimated share of the instance's cached blocks the index holds: 1 when exact, else
        the share of its evictions since the loss that named a block the index held."""
        if self.exact:
            return 1.0
        total = self.num_removals_since_loss
        if not total:
            return 0.0
        return 1.0 - self.num_unknown_removals_since_loss / total


class Router:
    """Routes requests to instances; its index learns only from the instances' events.

    Hashes: with `hash_format="int64"` (default, the wire's default) digest hashes, from
    in-process events or requests, are reduced to their low 64 bits on the way in, so events
    taken straight from a manager and events decoded from the wire index alike. With
    "bytes", hashes are used as given (publish with `hash_format="bytes"`).

    Feeding: `apply_batch(instance, seq, batch)` for batches from a stream (a subscriber's
    `ReceivedBatch`), `apply_events(instance, events)` for events handed over in process,
    `mark_lost(instance)` when a subscriber lost batches for good.

    Exactness contract: the index starts empty (the first call claims it and clears every
    instance). A snapshot batch replaces an instance's entries and makes them exact; stream
    batches it already contains (seq below its `snapshot_next_seq`) are skipped, so nothing is
    applied twice. A loss clears the instance's entries (inexact, never a phantom hit) until a
    snapshot arrives; `maybe_recover` asks `snapshot_source` for one every `retry_interval_s`.

    Outage contract: when the index raises `IndexUnavailableError` (Redis down, stalled,
    restarted empty), the router logs one warning, routes with `fallback` (least-loaded by
    default) and drops incoming events. Every `retry_interval_s` it pings the index; once it
    answers, the router claims it (writes from before the outage cannot land late) and
    resynchronises every instance from `snapshot_source` (or clears it without one:
    inexact), and prefix-aware routing resumes.
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
        grace_s: float = 30.0,
        hash_check: BlockHashCheck | None = None,
    ) -> None:
        if hash_format not in ("int64", "bytes"):
            raise InvalidArgumentError(
                f"hash_format must be 'int64' or 'bytes', got {hash_format!r}"
            )
        ids = [check_instance_id(i) for i in instance_ids]
        if not ids or len(set(ids)) != len(ids):
            raise InvalidArgumentError(f"instance ids must be non-empty and unique, got {ids}")
        if not retry_interval_s >= 0:
            raise InvalidArgumentError(f"retry_interval_s must be >= 0, got {retry_interval_s!r}")
        if not grace_s >= 0:
            raise InvalidArgumentError(f"grace_s must be >= 0, got {grace_s!r}")
        self.instance_ids = ids
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.index: PrefixIndex = index if index is not None else InMemoryPrefixIndex()
        self.shadow: InMemoryPrefixIndex | None = None
        """With a shared backend (Redis): the router's own copy of every instance's entries,
        fed even while the backend is down, from which the backend is rebuilt."""
        if not isinstance(self.index, InMemoryPrefixIndex):
            self.shadow = InMemoryPrefixIndex(
                idempotent_stores=getattr(self.index, "idempotent_stores", False)
            )
        self.grace_s = grace_s
        self.hash_check = hash_check
        self.fallback = fallback or LeastLoadedPolicy()
        if self.fallback.uses_index:
            raise InvalidArgumentError("the fallback policy must not need the index")
        self.snapshot_source = snapshot_source
        self.retry_interval_s = retry_interval_s
        self.clock = clock
        self._use_int = hash_format == "int64"
        self.states = {i: InstanceState() for i in ids}
        self.degraded = False
        """The index cannot be used (unreachable, or lost): routing falls back."""
        self._claimed = False
        self._last_attempt: float | None = None
        self.num_outages = 0
        self.num_recoveries = 0
        self.num_fallback_decisions = 0
        self.num_dropped_event_batches = 0

    @property
    def exact(self) -> bool:
        """Whether the index equals every instance's cache (as of the batches applied)."""
        return not self.degraded and all(s.exact and s.safe for s in self.states.values())

    @property
    def ready(self) -> bool:
        """Whether the router's answers can be trusted: the index is usable, every instance
        was live once or is declared down, none is misconfigured, and one at least is safe."""
        states = self.states.values()
        return (
            not self.degraded
            and self._claimed
            and all(s.ever_live or s.down not in (None, NOT_CONNECTED_YET) for s in states)
            and all(s.misconfigured is None for s in states)
            and any(s.safe for s in states)
        )

    def serving(self, instance_id: str) -> bool:
        """Whether the instance may be scored and routed to (safe: no phantom possible)."""
        return self.states[instance_id].safe

    # ------------------------------------------------------------------ feeding

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> bool:
        """Feed one instance's events to the index; False if dropped (index unavailable)."""
        return self._apply(self._state(instance_id), instance_id, events)

    def apply_batch(self, instance_id: str, seq: int, batch: EventBatch) -> bool:
        """Feed one stream batch numbered `seq` (a snapshot: its `snapshot_next_seq`).

        Returns False if the index did not take it (unavailable; the router's own copy, with a
        shared backend, still did); True if applied, or skipped because the last snapshot
        applied already contains it.
        """
        state = self._state(instance_id)
        # Usable first: a recovery inside this call installs snapshots, which moves the floor
        # this batch is checked against.
        usable = self._usable()
        if not usable and self.shadow is None:
            self.num_dropped_event_batches += 1
            return False
        if batch.snapshot_next_seq is not None:
            try:
                self._install_snapshot(instance_id, batch, usable)
            except IndexUnavailableError as exc:
                self._enter_outage(exc)
                self.num_dropped_event_batches += 1
                return False
            return usable
        if state.next_seq is not None and seq < state.next_seq:
            state.num_batches_skipped += 1
            return True
        return self._apply(state, instance_id, batch.events)

    def mark_lost(self, instance_id: str) -> None:
        """Batches of this instance were lost for good: clear its entries (inexact) until a
        snapshot brings them back."""
        state = self._state(instance_id)
        if state.exact:
            state.num_removals_since_loss = state.num_unknown_removals_since_loss = 0
        state.exact = False
        state.num_losses += 1
        self._clear(instance_id)

    def _clear(self, instance_id: str) -> None:
        if self.shadow is not None:
            self.shadow.clear_instance(instance_id)
        if self._usable():
            try:
                self.index.clear_instance(instance_id)
            except IndexUnavailableError as exc:
                self._enter_outage(exc)

    def set_connected(self, instance_id: str, connected: bool) -> None:
        """Record whether the instance's event stream is connected (reported; `set_down`
        decides whether it is served)."""
        self._state(instance_id).connected = connected

    def set_down(self, instance_id: str, reason: str | None) -> None:
        """Declare the instance's feed down (`reason`: why) or live again (None). Down: it
        scores 0 and is not routed to at once; its entries wait `grace_s` for the stream to
        resume without a restart (a restart clears them: `restart`)."""
        state = self._state(instance_id)
        if reason is None:
            if state.down is not None:
                logger.warning("instance %s is live again", instance_id)
            state.down = state.down_since = None
            state.ever_live = True
        elif state.down is None:
            logger.warning("instance %s is down (%s): not scored or routed to", instance_id, reason)
            state.down, state.down_since = reason, self.clock()
        else:
            state.down = reason

    def restart(self, instance_id: str) -> None:
        """The instance's publisher is a new one (empty cache, stream from 0): clear its
        entries now, before anything of the new stream is trusted; exact again."""
        state = self._state(instance_id)
        state.num_restarts += 1
        self._clear(instance_id)
        self._became_exact(instance_id, state)
        state.next_seq = None

    def expire_down(self) -> None:
        """Clear the entries of instances down for longer than `grace_s` (called by the feed)."""
        now = self.clock()
        for instance_id, state in self.states.items():
            since = state.down_since
            if since is None or state.entries_dropped or now - since < self.grace_s:
                continue
            logger.warning(
                "instance %s down for %.0f s (grace period): its index entries are dropped",
                instance_id,
                now - since,
            )
            state.entries_dropped = True
            if state.exact:
                state.num_removals_since_loss = state.num_unknown_removals_since_loss = 0
            state.exact = False
            self._clear(instance_id)

    def _became_exact(self, instance_id: str, state: InstanceState) -> None:
        state.exact = True
        state.entries_dropped = False
        state.misconfigured = None
        if self.hash_check is not None:
            self.hash_check.reset(instance_id)

    def _check_hashes(
        self, state: InstanceState, instance_id: str, events: list[KVCacheEvent]
    ) -> bool:
        """False (and the instance marked misconfigured, its entries cleared) on a mismatch."""
        check = self.hash_check
        if check is None or check.done(instance_id):
            return True
        problem = check.check(instance_id, events)
        if problem is None:
            return True
        if state.misconfigured is None:
            logger.error("%s", problem)
            self._clear(instance_id)
        state.misconfigured = problem
        return False

    def _state(self, instance_id: str) -> InstanceState:
        state = self.states.get(instance_id)
        if state is None:
            raise InvalidArgumentError(f"unknown instance {instance_id!r}")
        return state

    def _apply(
        self, state: InstanceState, instance_id: str, events: Iterable[KVCacheEvent]
    ) -> bool:
        stream = events if isinstance(events, list) else list(events)
        if state.misconfigured is not None or not self._check_hashes(state, instance_id, stream):
            state.num_batches_skipped += 1
            return True
        if self._use_int:
            stream = external_events(stream)
        shadow = self.shadow
        counter: Any = shadow if shadow is not None else self.index
        unknown_before = getattr(counter, "num_unknown_removals", 0)
        if shadow is not None:
            shadow.apply_events(instance_id, stream)  # the router's own copy: never dropped
        applied = False
        if self._usable():
            try:
                self.index.apply_events(instance_id, stream)
            except IndexUnavailableError as exc:
                self._enter_outage(exc)
            else:
                applied = True
        if not state.exact:
            self._track_coverage(state, instance_id, stream, unknown_before, counter)
        if applied or shadow is not None:
            state.num_batches_applied += 1
        if not applied:
            self.num_dropped_event_batches += 1
        return applied

    def _track_coverage(
        self,
        state: InstanceState,
        instance_id: str,
        events: list[KVCacheEvent],
        unknown_before: int,
        counter: Any,
    ) -> None:
        """An inexact instance: count its evictions (coverage); a clear makes it exact."""
        removed = 0
        for event in events:
            kind = type(event)
            if kind is BlockRemoved:
                removed += len(cast(BlockRemoved, event).block_hashes)
            elif kind is AllBlocksCleared:
                self._became_exact(instance_id, state)  # the engine emptied its cache itself
                return
        state.num_removals_since_loss += removed
        unknown = getattr(counter, "num_unknown_removals", 0) - unknown_before
        state.num_unknown_removals_since_loss += max(0, min(unknown, removed))

    # ------------------------------------------------------------------ routing

    def route(
        self,
        block_hashes: Sequence[Hashable],
        loads: Mapping[str, float],
        candidates: Sequence[str] | None = None,
        policy: RoutingPolicy | None = None,
    ) -> RoutingDecision:
        """Pick an instance (among `candidates`, default all; with `policy`, default the
        router's) for a request with these (external) block hashes."""
        policy = policy or self.policy
        wanted = self.instance_ids if candidates is None else candidates
        if not wanted:
            raise InvalidArgumentError("no candidate instance to route to")
        ids = [i for i in wanted if self.states[i].safe]
        if not ids:
            reasons = {i: self.states[i].down or self.states[i].misconfigured for i in wanted}
            raise NoInstanceAvailableError(f"no instance can take the request now: {reasons}")
        if not policy.uses_index:
            return RoutingDecision(policy.choose(ids, loads, None), policy.name, 0, False)
        try:
            lengths = self.score(block_hashes, ids)
        except IndexUnavailableError:
            self.num_fallback_decisions += 1
            chosen = self.fallback.choose(ids, loads, None)
            return RoutingDecision(chosen, self.fallback.name, 0, True)
        chosen = policy.choose(ids, loads, lengths)
        return RoutingDecision(chosen, policy.name, lengths[chosen], False, lengths)

    def score(
        self, block_hashes: Sequence[Hashable], instance_ids: Sequence[str] | None = None
    ) -> dict[str, int]:
        """Each instance's longest cached prefix of the request, in blocks, per the index
        (0 for an instance that is down or misconfigured).

        Raises `IndexUnavailableError` while the index cannot be used (after a failed call,
        until the next successful retry).
        """
        ids = self.instance_ids if instance_ids is None else instance_ids
        if not self._usable():
            raise IndexUnavailableError("the prefix index is unavailable")
        if self._use_int and block_hashes and type(block_hashes[0]) is bytes:
            block_hashes = [to_external_hash(cast(bytes, h)) for h in block_hashes]
        states = self.states
        served = [i for i in ids if states[i].safe]
        try:
            lengths = self.index.match_lengths(block_hashes, served)
        except IndexUnavailableError as exc:
            self._enter_outage(exc)
            raise
        if len(served) == len(ids):
            return lengths
        return {i: lengths.get(i, 0) for i in ids}  # down or misconfigured: never a hit

    # ------------------------------------------------------------------ outages and recovery

    def _usable(self) -> bool:
        # Called from HTTP handlers: what this may start uses no snapshot source (whose sockets
        # belong to the feed thread): claiming clears, a shared backend is rebuilt from
        # `shadow`, and an in-memory index never becomes unavailable.
        if self.degraded or not self._claimed:
            self.maybe_recover()
        return not self.degraded and self._claimed

    def maybe_recover(self, force: bool = False, resync_inexact: bool = True) -> None:
        """If the index is down, or (with `resync_inexact`) an instance is inexact and a
        snapshot source exists, try to resynchronise, at most once per `retry_interval_s`
        (`force`: now). A caller that fetches snapshots itself (off a lock) passes
        `resync_inexact=False` and hands them to `apply_batch`."""
        inexact = [i for i, state in self.states.items() if not state.exact]
        if not resync_inexact:
            inexact = []
        if self._claimed and not self.degraded and not (inexact and self.snapshot_source):
            return
        now = self.clock()
        last = self._last_attempt
        if not force and last is not None and now - last < self.retry_interval_s:
            return
        self._last_attempt = now
        try:
            if not self._claimed or self.degraded:
                self._resync_all()
            else:
                for instance_id in inexact:
                    self._resync(instance_id)
        except IndexUnavailableError as exc:
            self._enter_outage(exc)

    def _resync_all(self) -> None:
        self.index.ping()
        self.index.claim()
        first = not self._claimed
        for instance_id in self.instance_ids:
            if first:
                # Start: nothing applied yet, and the stream will deliver everything. What a
                # populated backend holds is not trusted: its epoch is not ours.
                self.index.clear_instance(instance_id)
            elif self.shadow is not None:
                self._rebuild(instance_id, self.shadow)
            else:
                self._resync(instance_id)
        self._claimed = True
        if self.degraded:
            self.degraded = False
            self.num_recoveries += 1
            inexact = [i for i, state in self.states.items() if not state.exact]
            logger.warning(
                "prefix index recovered: %d instances resynchronised%s; prefix-aware routing "
                "resumes" + (" (rebuilt from the router's own copy)" if self.shadow else ""),
                len(self.instance_ids) - len(inexact),
                f", {len(inexact)} cleared (no snapshot): {inexact}" if inexact else "",
            )

    def _rebuild(self, instance_id: str, shadow: InMemoryPrefixIndex) -> None:
        """Write the router's own copy of the instance's entries into the backend."""
        per_where: dict[tuple[str | None, int | None], list[Hashable]] = {}
        for (medium, group, block_hash), count in shadow.instance_contents(instance_id).items():
            per_where.setdefault((medium, group), []).extend([block_hash] * count)
        events: list[KVCacheEvent] = [AllBlocksCleared()]
        for (medium, group), hashes in per_where.items():
            events.append(BlockStored(hashes, None, [], 0, None, medium, group_idx=group))  # type: ignore[arg-type]
        self.index.apply_events(instance_id, events)

    def _resync(self, instance_id: str) -> None:
        source = self.snapshot_source(instance_id) if self.snapshot_source else None
        if source is None:
            self.index.clear_instance(instance_id)
            if self.shadow is not None:
                self.shadow.clear_instance(instance_id)
            state = self.states[instance_id]
            if state.exact:
                state.num_removals_since_loss = state.num_unknown_removals_since_loss = 0
            state.exact = False
        else:
            self._install_snapshot(instance_id, source)

    def _install_snapshot(
        self,
        instance_id: str,
        source: EventBatch | Iterable[KVCacheEvent],
        to_index: bool = True,
    ) -> None:
        state = self.states[instance_id]
        next_seq = None
        if isinstance(source, EventBatch):
            next_seq = source.snapshot_next_seq
            source = source.events
        # A snapshot replaces what the instance held: clear first even if it does not.
        events: list[KVCacheEvent] = [AllBlocksCleared(), *source]
        if self._use_int:
            events = external_events(events)
        if self.shadow is not None:
            self.shadow.apply_events(instance_id, events)
        if to_index:
            self.index.apply_events(instance_id, events)
        self._became_exact(instance_id, state)
        state.num_snapshots += 1
        if next_seq is not None:
            state.next_seq = next_seq

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
