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
    and one AND per block; `_copies[i][where][h]` counts instance i's copies of h in `where`.

    Invariants (`check_invariants`): every count is positive; bit(i) is set in `_holders[h]`
    iff some `_copies[i][where]` holds h; no `_holders` entry is 0.
    """

    def __init__(self, *, idempotent_stores: bool | Collection[str] = False) -> None:
        self._bit_of: dict[str, int] = {}
        self._ids: list[str] = []  # bit position -> instance id
        self._holders: dict[Hashable, int] = {}
        self._copies: dict[str, dict[Where, dict[Hashable, int]]] = {}
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
        return bit

    def is_idempotent(self, instance_id: str) -> bool:
        idempotent = self._idempotent
        return idempotent if isinstance(idempotent, bool) else instance_id in idempotent

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> None:
        bit = self._slot(instance_id)
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
        per_where = self._copies[instance_id]
        for counts in per_where.values():
            for block_hash in counts:
                remaining = holders.get(block_hash, 0) & ~bit
                if remaining:
                    holders[block_hash] = remaining
                else:
                    holders.pop(block_hash, None)
        per_where.clear()

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
                for (medium, _), counts in self._copies.get(instance_id, {}).items()
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
                    for where, counts in self._copies[instance_id].items()
                    if block_hash in counts
                }
        return out

    def instance_contents(self, instance_id: str) -> dict[CacheKey, int]:
        out: dict[CacheKey, int] = {}
        for (medium, group), counts in self._copies.get(instance_id, {}).items():
            for block_hash, count in counts.items():
                out[(medium, group, block_hash)] = count
        return out

    def instance_ids(self) -> list[str]:
        return [i for i in self._ids if any(self._copies[i].values())]

    @property
    def num_hashes(self) -> int:
        """Distinct block hashes held by at least one instance."""
        return len(self._holders)

    def ping(self) -> None:
        return None

    def check_invariants(self) -> None:
        expected: dict[Hashable, int] = {}
        for instance_id, per_where in self._copies.items():
            bit = self._bit_of[instance_id]
            for where, counts in per_where.items():
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
