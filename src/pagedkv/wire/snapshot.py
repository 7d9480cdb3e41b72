"""Adapter (stdlib): one pool's prefix-cache contents mirrored from its KV events, and the
snapshot that rebuilds them. Reads only `pagedkv.events`; never touches a pool.

The publisher keeps a mirror so a consumer that joined late, or lost events beyond the replay
window, can resynchronise (docs/events.md, "Snapshots").
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from pagedkv.errors import InvariantViolation
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

CacheKey = tuple[str | None, int | None, Hashable]
"""(medium, group_idx, block hash): how a consumer keys a cached block."""


@dataclass(slots=True)
class _StoredRecord:
    event: BlockStored
    num_live_blocks: int


class CacheMirror:
    """Cached blocks of one producer, rebuilt by applying its events in order.

    Invariants (`check_invariants`): every live entry names a recorded event and a position in
    its `block_hashes` whose hash is the entry's key; an event's `num_live_blocks` equals the
    entries naming it. A hash stored twice (two blocks with one hash) has two entries, as the
    pool holds two blocks; `BlockRemoved` drops one (the newest).
    """

    def __init__(self) -> None:
        # key -> stack of (event serial, position in the event's block_hashes)
        self._entries: dict[CacheKey, list[tuple[int, int]]] = {}
        self._events: dict[int, _StoredRecord] = {}
        self._next_serial = 0
        self.num_unknown_removals = 0
        """BlockRemoved for a key the mirror did not hold (it started after the store)."""

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        """Apply events in order (any hash form: digests or external ints, but one form)."""
        entries = self._entries
        for event in events:
            # `type(event) is`, not isinstance: exact types, and mypy narrows on it.
            if type(event) is BlockStored:
                serial = self._next_serial
                self._next_serial += 1
                medium, group = event.medium, event.group_idx
                for position, block_hash in enumerate(event.block_hashes):
                    stack = entries.get((medium, group, block_hash))
                    if stack is None:
                        entries[(medium, group, block_hash)] = [(serial, position)]
                    else:
                        stack.append((serial, position))
                if event.block_hashes:
                    self._events[serial] = _StoredRecord(event, len(event.block_hashes))
            elif type(event) is BlockRemoved:
                medium, group = event.medium, event.group_idx
                for block_hash in event.block_hashes:
                    key = (medium, group, block_hash)
                    stack = entries.get(key)
                    if not stack:
                        self.num_unknown_removals += 1
                        continue
                    serial, _ = stack.pop()
                    if not stack:
                        del entries[key]
                    record = self._events[serial]
                    record.num_live_blocks -= 1
                    if record.num_live_blocks == 0:
                        del self._events[serial]
            elif type(event) is AllBlocksCleared:
                self.clear()

    def clear(self) -> None:
        self._entries.clear()
        self._events.clear()

    def block_counts(self) -> dict[CacheKey, int]:
        """Cached blocks per (medium, group_idx, hash): > 1 where blocks share a hash."""
        return {key: len(stack) for key, stack in self._entries.items()}

    @property
    def num_cached_blocks(self) -> int:
        return sum(len(stack) for stack in self._entries.values())

    def snapshot_events(self) -> list[KVCacheEvent]:
        """Events that rebuild this state from nothing: `AllBlocksCleared`, then the stores.

        One `BlockStored` per run of consecutive still-cached blocks of an original event, in
        the original order, with the run's parent hash, tokens and extra keys. Token ids are
        left empty where the original event's tokens cannot be split per block (it skipped
        null blocks, which only sliding-window groups do).
        """
        live_positions: dict[int, list[int]] = {}
        for stack in self._entries.values():
            for serial, position in stack:
                live_positions.setdefault(serial, []).append(position)
        out: list[KVCacheEvent] = [AllBlocksCleared()]
        for serial in sorted(live_positions):
            event = self._events[serial].event
            positions = sorted(live_positions[serial])
            run_start = previous = positions[0]
            for position in positions[1:]:
                if position == previous + 1:
                    previous = position
                    continue
                out.append(_slice_stored(event, run_start, previous + 1))
                run_start = previous = position
            out.append(_slice_stored(event, run_start, previous + 1))
        return out

    def check_invariants(self) -> None:
        live: dict[int, int] = {}
        for key, stack in self._entries.items():
            if not stack:
                raise InvariantViolation(f"empty entry stack for {key!r}")
            for serial, position in stack:
                record = self._events.get(serial)
                if record is None:
                    raise InvariantViolation(f"entry {key!r} names a dropped event {serial}")
                if record.event.block_hashes[position] != key[2]:
                    raise InvariantViolation(f"entry {key!r} points at another hash")
                live[serial] = live.get(serial, 0) + 1
        for serial, record in self._events.items():
            if live.get(serial, 0) != record.num_live_blocks:
                raise InvariantViolation(
                    f"event {serial}: {record.num_live_blocks} live blocks recorded, "
                    f"{live.get(serial, 0)} entries"
                )


def _slice_stored(event: BlockStored, start: int, end: int) -> BlockStored:
    """The part [start, end) of a stored event, with its own parent, tokens and extra keys."""
    num_blocks = len(event.block_hashes)
    if start == 0 and end == num_blocks:
        token_ids = list(event.token_ids)
    elif len(event.token_ids) == num_blocks * event.block_size:
        token_ids = event.token_ids[start * event.block_size : end * event.block_size]
    else:
        token_ids = []
    return BlockStored(
        block_hashes=event.block_hashes[start:end],
        parent_block_hash=event.parent_block_hash if start == 0 else event.block_hashes[start - 1],
        token_ids=token_ids,
        block_size=event.block_size,
        lora_id=event.lora_id,
        medium=event.medium,
        lora_name=event.lora_name,
        extra_keys=None if event.extra_keys is None else event.extra_keys[start:end],
        group_idx=event.group_idx,
        kv_cache_spec_kind=event.kv_cache_spec_kind,
        kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
        locality=event.locality,
        ownership=event.ownership,
        session_id=event.session_id,
        lookahead_token_ids=(
            None if event.lookahead_token_ids is None else event.lookahead_token_ids[start:end]
        ),
    )
