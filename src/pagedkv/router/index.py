"""Router layer: the cluster-wide prefix index contract and its in-memory backend.

The index is fed only by KV events, per instance: block hash -> the instances caching it, with
the medium (tier) and group of each copy. It scores an instance by the longest run of a
request's block hashes, from the first, that the instance caches.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Any, Protocol

from pagedkv.errors import InvalidArgumentError, InvariantViolation, PagedKVError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

CacheKey = tuple[str | None, int | None, Hashable]
"""(medium, group_idx, block hash): one cached copy's identity, as `CacheMirror` keys it."""

Where = tuple[str | None, int | None]
"""(medium, group_idx) of a copy."""


class IndexUnavailableError(PagedKVError, ConnectionError):
    """The index backend cannot be reached (for example Redis is down)."""


class IndexLostError(IndexUnavailableError):
    """The backend answers but no longer holds what this writer wrote (restarted empty, flushed,
    or another writer took over): the index must be resynchronised before it is trusted."""


def check_instance_id(instance_id: object) -> str:
    if not isinstance(instance_id, str) or not instance_id or "|" in instance_id:
        raise InvalidArgumentError(
            f"instance id must be a non-empty str without '|', got {instance_id!r}"
        )
    return instance_id


def idempotent_set(idempotent_stores: bool | Collection[str]) -> frozenset[str] | bool:
    """Normalise the `idempotent_stores` argument: True/False for all, or a set of ids."""
    if isinstance(idempotent_stores, bool):
        return idempotent_stores
    return frozenset(check_instance_id(i) for i in idempotent_stores)


class PrefixIndex(Protocol):
    """What a router needs from an index backend (in-memory, Redis).

    Store semantics, per instance, chosen at construction (`idempotent_stores`):
    - copies (default): each `BlockStored` of a hash is one more copy and each `BlockRemoved`
      drops one, as pagedkv and vLLM publish by default (two blocks may share a hash). Exact.
    - idempotent: a `BlockStored` of a hash the instance already holds (in that medium and
      group) is a no-op and a `BlockRemoved` drops it. For vLLM requests with
      `kv_cache_report_mode="full"`, which re-send `BlockStored` for prefix hits: counting
      those as copies would keep blocks the instance evicted. The price: when two real blocks
      share a hash and one is evicted, the index forgets the survivor (a missed hit, never a
      phantom one). No index can be exact under both duplicates and re-sends: store, store,
      remove means one copy left or none, and the events do not say which.
    """

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> None:
        """Apply one instance's events in order (`AllBlocksCleared` clears that instance)."""

    def clear_instance(self, instance_id: str) -> None: ...

    def match_lengths(
        self,
        block_hashes: Sequence[Hashable],
        instance_ids: Iterable[str],
        media: Collection[str | None] | None = None,
    ) -> dict[str, int]:
        """For each instance, how many leading `block_hashes` it caches (in `media`, if given)."""

    def instance_contents(self, instance_id: str) -> dict[CacheKey, int]:
        """Cached copies of one instance: (medium, group, hash) -> count."""

    def ping(self) -> None:
        """Return if the backend is reachable, else raise `IndexUnavailableError`."""

    def claim(self) -> None:
        """Become the index's writer from now on: writes made before (by an earlier writer, or
        by this one before an outage) can no longer land. Then clear or resync instances."""


class InMemoryPrefixIndex:
    """A prefix index in this process.

    Layout: each instance has a bit; `_holders[h]` is the bitmask of instances holding at
    least one copy of hash h (any medium or group), so scoring a request is one dict lookup
    and one AND per block. An instance whose copies all live in one (medium, group), `_main[i]`
    (every instance, until a store names a second one), needs nothing else: its bit is its
    presence and `_extras[i][h]` its copy count where above 1, so an update costs one lookup
    in `_holders`. An instance in a second (medium, group) moves for good to `_copies[i][where]
    [h]` (copy counts per table; `_general`). Clearing a one-table instance scans `_holders`.

    Invariants (`check_invariants`): no `_holders` entry is 0; for a general instance, bit(i)
    is set in `_holders[h]` iff some `_copies[i][where]` holds h and every count is positive;
    for a one-table instance, every `_extras` key has its bit set and a count of at least 2.
    """

    def __init__(self, *, idempotent_stores: bool | Collection[str] = False) -> None:
        self._bit_of: dict[str, int] = {}
        self._ids: list[str] = []  # bit position -> instance id
        self._holders: dict[Hashable, int] = {}
        self._copies: dict[str, dict[Where, dict[Hashable, int]]] = {}
        self._general: set[str] = set()
        self._main: dict[str, Where | None] = {}
        self._extras: dict[str, dict[Hashable, int]] = {}
        self._idempotent = idempotent_set(idempotent_stores)
        self.num_unknown_removals = 0
        """`BlockRemoved` for a copy the index did not hold (events applied after a loss)."""

    def _slot(self, instance_id: str) -> int:
        bit = self._bit_of.get(instance_id)
        if bit is None:
            check_instance_id(instance_id)
            bit = self._bit_of[instance_id] = 1 << len(self._ids)
            self._ids.append(instance_id)
            self._copies[instance_id] = {}
            self._main[instance_id] = None
            self._extras[instance_id] = {}
        return bit

    @property
    def idempotent_stores(self) -> frozenset[str] | bool:
        return self._idempotent

    def is_idempotent(self, instance_id: str) -> bool:
        idempotent = self._idempotent
        return idempotent if isinstance(idempotent, bool) else instance_id in idempotent

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> None:
        bit = self._slot(instance_id)
        if instance_id in self._general:
            self._apply_general(instance_id, bit, events)
            return
        stream = events if isinstance(events, list) else list(events)
        num_done = self._apply_one_table(instance_id, bit, stream)
        if num_done < len(stream):
            self._make_general(instance_id, bit)
            self._apply_general(instance_id, bit, stream[num_done:])

    def _apply_one_table(self, instance_id: str, bit: int, events: list[Any]) -> int:
        """Apply events while they stay in the instance's one table; return how many."""
        holders = self._holders
        holders_get = holders.get
        extras = self._extras[instance_id]
        idempotent = self.is_idempotent(instance_id)
        main = self._main[instance_id]
        medium, group = main if main is not None else ((), ())
        unknown = 0
        # Hot path: one `_holders` lookup per block update, no call or object per event.
        for position, event in enumerate(events):
            kind = type(event)
            if kind is BlockRemoved:
                if event.medium != medium or event.group_idx != group:
                    unknown += len(event.block_hashes)  # a table it holds nothing in
                    continue
                for block_hash in event.block_hashes:
                    mask = holders_get(block_hash)
                    if mask is None or not mask & bit:
                        unknown += 1
                    elif extras and block_hash in extras:
                        count = extras[block_hash]
                        if count == 2:
                            del extras[block_hash]
                        else:
                            extras[block_hash] = count - 1
                    elif mask == bit:
                        del holders[block_hash]
                    else:
                        holders[block_hash] = mask ^ bit
            elif kind is BlockStored:
                if event.medium != medium or event.group_idx != group:
                    if main is not None:
                        self.num_unknown_removals += unknown
                        return position  # a second table: the general layout from here
                    medium, group = event.medium, event.group_idx
                    main = self._main[instance_id] = (event.medium, event.group_idx)
                for block_hash in event.block_hashes:
                    mask = holders_get(block_hash)
                    if mask is None:
                        holders[block_hash] = bit
                    elif not mask & bit:
                        holders[block_hash] = mask | bit
                    elif not idempotent:
                        extras[block_hash] = extras.get(block_hash, 1) + 1
            elif kind is AllBlocksCleared:
                self.clear_instance(instance_id)
                main = None
                medium = group = ()
        self.num_unknown_removals += unknown
        return len(events)

    def _make_general(self, instance_id: str, bit: int) -> None:
        """Move a one-table instance to per-table copy counts (it stores in a second table)."""
        main = self._main[instance_id]
        extras = self._extras[instance_id]
        table = {h: extras.get(h, 1) for h, mask in self._holders.items() if mask & bit}
        self._copies[instance_id] = {} if main is None else {main: table}
        extras.clear()
        self._general.add(instance_id)

    def _apply_general(self, instance_id: str, bit: int, events: Iterable[KVCacheEvent]) -> None:
        per_where = self._copies[instance_id]
        holders = self._holders
        holders_get = holders.get
        idempotent = self.is_idempotent(instance_id)
        # Hot path: one pass, no call, tuple or object per event or block. The copy table of
        # the last (medium, group) stays bound, since a stream is mostly one BlockRemoved per
        # evicted block, all in one table; measured faster than bulk dict operations over
        # merged runs (benchmarks/bench_router_index.py).
        medium: object = ()
        group: object = ()
        counts: dict[Hashable, int] = {}
        counts_get = counts.get
        several_tables = False
        unknown = 0
        stream: Iterable[Any] = events  # narrowed by `type(...) is`, which mypy cannot follow
        for event in stream:
            kind = type(event)
            if kind is BlockRemoved:
                if event.medium != medium or event.group_idx != group:
                    medium, group = event.medium, event.group_idx
                    counts = self._table(per_where, (event.medium, event.group_idx))
                    counts_get = counts.get
                    several_tables = len(per_where) > 1
                for block_hash in event.block_hashes:
                    count = counts_get(block_hash)
                    if count == 1:
                        del counts[block_hash]
                        if several_tables and any(block_hash in c for c in per_where.values()):
                            continue  # still held in another medium or group
                        remaining = holders[block_hash] ^ bit
                        if remaining:
                            holders[block_hash] = remaining
                        else:
                            del holders[block_hash]
                    elif count is None:
                        unknown += 1
                    else:
                        counts[block_hash] = count - 1
            elif kind is BlockStored:
                if event.medium != medium or event.group_idx != group:
                    medium, group = event.medium, event.group_idx
                    counts = self._table(per_where, (event.medium, event.group_idx))
                    counts_get = counts.get
                    several_tables = len(per_where) > 1
                for block_hash in event.block_hashes:
                    if counts_get(block_hash) is None:
                        counts[block_hash] = 1
                        holders[block_hash] = holders_get(block_hash, 0) | bit
                    elif not idempotent:
                        counts[block_hash] += 1
            elif kind is AllBlocksCleared:
                self.clear_instance(instance_id)
                medium = group = ()  # the bound table is gone
        if unknown:
            self.num_unknown_removals += unknown

    @staticmethod
    def _table(per_where: dict[Where, dict[Hashable, int]], where: Where) -> dict[Hashable, int]:
        counts = per_where.get(where)
        if counts is None:
            counts = per_where[where] = {}
        return counts

    def clear_instance(self, instance_id: str) -> None:
        bit = self._slot(instance_id)
        holders = self._holders
        if instance_id in self._general:
            hashes: Iterable[Hashable] = {h for c in self._copies[instance_id].values() for h in c}
            self._copies[instance_id].clear()  # in place: an apply loop may hold it
        else:
            hashes = [h for h, mask in holders.items() if mask & bit]
        for block_hash in hashes:
            remaining = holders[block_hash] & ~bit
            if remaining:
                holders[block_hash] = remaining
            else:
                del holders[block_hash]
        self._extras[instance_id].clear()
        self._main[instance_id] = None

    def claim(self) -> None:
        return None  # one process, one writer

    def match_lengths(
        self,
        block_hashes: Sequence[Hashable],
        instance_ids: Iterable[str],
        media: Collection[str | None] | None = None,
    ) -> dict[str, int]:
        lengths = dict.fromkeys(instance_ids, 0)
        if media is not None:
            return self._match_in_media(block_hashes, lengths, media)
        bit_of = self._bit_of
        alive = 0
        for instance_id in lengths:
            alive |= bit_of.get(instance_id, 0)
        if not alive:
            return lengths
        get = self._holders.get
        ids = self._ids
        depth = 0
        # Hot path: one lookup and one AND per block; instances drop out as their run ends.
        for block_hash in block_hashes:
            still = alive & get(block_hash, 0)
            if still != alive:
                dropped = alive ^ still
                while dropped:
                    low = dropped & -dropped
                    lengths[ids[low.bit_length() - 1]] = depth
                    dropped ^= low
                alive = still
                if not alive:
                    return lengths
            depth += 1
        while alive:
            low = alive & -alive
            lengths[ids[low.bit_length() - 1]] = depth
            alive ^= low
        return lengths

    def _match_in_media(
        self,
        block_hashes: Sequence[Hashable],
        lengths: dict[str, int],
        media: Collection[str | None],
    ) -> dict[str, int]:
        for instance_id in lengths:
            tables = [
                counts
                for (medium, _), counts in self._tables(instance_id).items()
                if medium in media
            ]
            depth = 0
            for block_hash in block_hashes:
                if not any(block_hash in counts for counts in tables):
                    break
                depth += 1
            lengths[instance_id] = depth
        return lengths

    def lookup(self, block_hash: Hashable) -> dict[str, dict[Where, int]]:
        """Who caches `block_hash`: instance -> (medium, group) -> copies."""
        out: dict[str, dict[Where, int]] = {}
        mask = self._holders.get(block_hash, 0)
        for position, instance_id in enumerate(self._ids):
            if mask >> position & 1:
                out[instance_id] = {
                    where: counts[block_hash]
                    for where, counts in self._tables(instance_id).items()
                    if block_hash in counts
                }
        return out

    def instance_contents(self, instance_id: str) -> dict[CacheKey, int]:
        out: dict[CacheKey, int] = {}
        for (medium, group), counts in self._tables(instance_id).items():
            for block_hash, count in counts.items():
                out[(medium, group, block_hash)] = count
        return out

    def instance_ids(self) -> list[str]:
        return [i for i in self._ids if any(self._tables(i).values())]

    def _tables(self, instance_id: str) -> dict[Where, dict[Hashable, int]]:
        """(medium, group) -> hash -> copies, in either layout (a one-table instance's is
        built by scanning `_holders`: for reads off the hot path)."""
        bit = self._bit_of.get(instance_id)
        if bit is None:
            return {}
        if instance_id in self._general:
            return self._copies[instance_id]
        main = self._main[instance_id]
        if main is None:
            return {}
        extras = self._extras[instance_id]
        return {main: {h: extras.get(h, 1) for h, mask in self._holders.items() if mask & bit}}

    @property
    def num_hashes(self) -> int:
        """Distinct block hashes held by at least one instance."""
        return len(self._holders)

    def ping(self) -> None:
        return None

    def check_invariants(self) -> None:
        expected: dict[Hashable, int] = {}
        for instance_id, bit in self._bit_of.items():
            extras = self._extras[instance_id]
            if instance_id in self._general and extras:
                raise InvariantViolation(f"general instance {instance_id} has one-table extras")
            for block_hash, count in extras.items():
                if count < 2 or not self._holders.get(block_hash, 0) & bit:
                    raise InvariantViolation(
                        f"{instance_id}: extra copies {count} of {block_hash!r}"
                    )
            for where, counts in self._tables(instance_id).items():
                for block_hash, count in counts.items():
                    if count <= 0:
                        raise InvariantViolation(
                            f"{instance_id} holds {count} copies of {block_hash!r} in {where}"
                        )
                    expected[block_hash] = expected.get(block_hash, 0) | bit
        if expected != self._holders:
            wrong = {h for h in expected.keys() | self._holders.keys()
                     if expected.get(h) != self._holders.get(h)}  # fmt: skip
            raise InvariantViolation(f"holder masks disagree with copy counts for {wrong!r}")
