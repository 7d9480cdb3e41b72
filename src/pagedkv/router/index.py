"""Router layer: the cluster-wide prefix index contract and its in-memory backend.

The index is fed only by KV events, per instance: block hash -> the instances caching it, with
the medium (tier) and group of each copy. It scores an instance by the longest run of a
request's block hashes, from the first, that the instance caches.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Iterable, Sequence
from typing import Protocol

from pagedkv.errors import InvalidArgumentError, InvariantViolation, PagedKVError
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

CacheKey = tuple[str | None, int | None, Hashable]
"""(medium, group_idx, block hash): one cached copy's identity, as `CacheMirror` keys it."""


class IndexUnavailableError(PagedKVError, ConnectionError):
    """The index backend cannot be reached (for example Redis is down)."""


def check_instance_id(instance_id: object) -> str:
    if not isinstance(instance_id, str) or not instance_id or "|" in instance_id:
        raise InvalidArgumentError(
            f"instance id must be a non-empty str without '|', got {instance_id!r}"
        )
    return instance_id


class PrefixIndex(Protocol):
    """What a router needs from an index backend (in-memory, Redis)."""

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


class InMemoryPrefixIndex:
    """A prefix index in this process.

    Invariants (`check_invariants`): `_holders[h][i]` maps (medium, group) to a positive count
    for every copy of hash h on instance i, and h is in `_instance_hashes[i]` iff i holds it.
    A hash stored twice on one instance (two blocks) counts 2; each `BlockRemoved` drops one.
    """

    def __init__(self) -> None:
        self._holders: dict[Hashable, dict[str, dict[tuple[str | None, int | None], int]]] = {}
        self._instance_hashes: dict[str, set[Hashable]] = {}
        self.num_unknown_removals = 0
        """`BlockRemoved` for a copy the index did not hold (events applied after a loss)."""

    def apply_events(self, instance_id: str, events: Iterable[KVCacheEvent]) -> None:
        check_instance_id(instance_id)
        holders_of = self._holders
        own = self._instance_hashes.setdefault(instance_id, set())
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                where = (event.medium, event.group_idx)
                for block_hash in event.block_hashes:
                    holders = holders_of.get(block_hash)
                    if holders is None:
                        holders = holders_of[block_hash] = {}
                    copies = holders.get(instance_id)
                    if copies is None:
                        holders[instance_id] = {where: 1}
                        own.add(block_hash)
                    else:
                        copies[where] = copies.get(where, 0) + 1
            elif kind is BlockRemoved:
                where = (event.medium, event.group_idx)
                for block_hash in event.block_hashes:
                    self._remove_copy(instance_id, block_hash, where, own)
            elif kind is AllBlocksCleared:
                self.clear_instance(instance_id)
                own = self._instance_hashes.setdefault(instance_id, set())

    def _remove_copy(
        self,
        instance_id: str,
        block_hash: Hashable,
        where: tuple[str | None, int | None],
        own: set[Hashable],
    ) -> None:
        holders = self._holders.get(block_hash)
        copies = holders.get(instance_id) if holders is not None else None
        count = copies.get(where, 0) if copies is not None else 0
        if count == 0:
            self.num_unknown_removals += 1
            return
        if count > 1:
            copies[where] = count - 1
            return
        del copies[where]
        if not copies:
            del holders[instance_id]
            own.discard(block_hash)
            if not holders:
                del self._holders[block_hash]

    def clear_instance(self, instance_id: str) -> None:
        for block_hash in self._instance_hashes.pop(instance_id, ()):
            holders = self._holders[block_hash]
            del holders[instance_id]
            if not holders:
                del self._holders[block_hash]

    def match_lengths(
        self,
        block_hashes: Sequence[Hashable],
        instance_ids: Iterable[str],
        media: Collection[str | None] | None = None,
    ) -> dict[str, int]:
        lengths = dict.fromkeys(instance_ids, 0)
        alive = list(lengths)
        holders_of = self._holders
        for depth, block_hash in enumerate(block_hashes, 1):
            holders = holders_of.get(block_hash)
            if holders is None:
                break
            if media is None:
                alive = [i for i in alive if i in holders]
            else:
                alive = [
                    i
                    for i in alive
                    if i in holders and any(where[0] in media for where in holders[i])
                ]
            if not alive:
                break
            for instance_id in alive:
                lengths[instance_id] = depth
        return lengths

    def lookup(self, block_hash: Hashable) -> dict[str, dict[tuple[str | None, int | None], int]]:
        """Who caches `block_hash`: instance -> (medium, group) -> copies."""
        holders = self._holders.get(block_hash, {})
        return {instance: dict(copies) for instance, copies in holders.items()}

    def instance_contents(self, instance_id: str) -> dict[CacheKey, int]:
        out: dict[CacheKey, int] = {}
        for block_hash in self._instance_hashes.get(instance_id, ()):
            for (medium, group), count in self._holders[block_hash][instance_id].items():
                out[(medium, group, block_hash)] = count
        return out

    def instance_ids(self) -> list[str]:
        return list(self._instance_hashes)

    def ping(self) -> None:
        return None

    def check_invariants(self) -> None:
        for block_hash, holders in self._holders.items():
            if not holders:
                raise InvariantViolation(f"hash {block_hash!r} has an empty holder map")
            for instance_id, copies in holders.items():
                if not copies or any(count <= 0 for count in copies.values()):
                    raise InvariantViolation(f"bad copy counts for {block_hash!r} on {instance_id}")
                if block_hash not in self._instance_hashes.get(instance_id, ()):
                    raise InvariantViolation(f"{instance_id} holds {block_hash!r} unrecorded")
        for instance_id, hashes in self._instance_hashes.items():
            for block_hash in hashes:
                if instance_id not in self._holders.get(block_hash, {}):
                    raise InvariantViolation(f"{instance_id} lists {block_hash!r} it does not hold")
