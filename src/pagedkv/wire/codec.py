"""Adapter (extra `[events]`): KV-event batches on the wire, byte-compatible with the reference.

A batch is the msgpack array `[ts, [event, ...], dp_rank]`; each event is a map tagged with
`"type"` holding only the non-default values of defaulted fields (the reference's
`omit_defaults` Structs), or, in the legacy layout, an array `[type, field, ...]`. Hashes go out
as their low 64 bits (default) or as the full digest. Beyond the reference, an optional fourth
element, the extension map `{"schema_version": 1, "snapshot_next_seq": N}`, which reference
decoders skip (an array-like Struct ignores trailing elements). msgspec is imported on first
use, so this module (and `EventBatch`) imports without the extra. See docs/events.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Literal

from pagedkv.errors import InvalidArgumentError, MissingDependencyError, PagedKVError, install_hint
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

SCHEMA_VERSION = 1
"""Version of our extensions (the extension map and snapshots). Bumped on incompatible change."""

Layout = Literal["map", "array"]
HashFormat = Literal["int64", "bytes"]

# A msgspec.defstruct field: (name, type) or (name, type, default).
_Field = tuple[str, Any] | tuple[str, Any, Any]

_LOW_64_BITS = 8
# Legacy arrays shorter than this (tag included) are padded with nil: fields added later.
_LEGACY_PADDING = {"BlockStored": 8, "BlockRemoved": 3}


class WireFormatError(PagedKVError, ValueError):
    """A payload is not a KV-event batch in any layout this decoder knows (names the defect)."""


@dataclass(slots=True)
class EventBatch:
    """One published batch.

    `schema_version` and `snapshot_next_seq` come from the extension map (None when the
    producer is a reference engine). A snapshot (`snapshot_next_seq` set) is an ordinary batch
    that starts with `AllBlocksCleared` and stores every cached block: applying it rebuilds the
    producer's cache contents after every batch numbered below `snapshot_next_seq`.
    """

    ts: float
    events: list[KVCacheEvent]
    data_parallel_rank: int | None = None
    schema_version: int | None = None
    snapshot_next_seq: int | None = None

    @property
    def is_snapshot(self) -> bool:
        return self.snapshot_next_seq is not None


@cache
def _structs() -> Any:
    """Build the msgspec Struct mirrors of the reference's event classes (once, on first use)."""
    try:
        import msgspec
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise MissingDependencyError(
            f"KV events on the wire need msgspec: {install_hint('events')}"
        ) from exc

    hash_type = int | bytes
    # Field order and defaults of the reference's Structs (REFERENCE 7.1): on the wire, order
    # is the contract (maps keep it; legacy arrays are positional).
    stored_fields: list[_Field] = [
        ("block_hashes", list[hash_type]),
        ("parent_block_hash", hash_type | None),
        ("token_ids", list[int]),
        ("block_size", int),
        ("lora_id", int | None),
        ("medium", str | None),
        ("lora_name", str | None),
        ("extra_keys", list[Any] | None, None),
        ("group_idx", int | None, None),
        ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None),
        ("locality", str | None, None),
        ("ownership", str | None, None),
        ("session_id", str | None, None),
        ("lookahead_token_ids", list[list[int]] | None, None),
    ]
    removed_fields: list[_Field] = [
        ("block_hashes", list[hash_type]),
        ("medium", str | None),
        ("group_idx", int | None, None),
        ("locality", str | None, None),
        ("ownership", str | None, None),
    ]

    def event_type(name: str, fields: list[_Field], array_like: bool) -> type:
        return msgspec.defstruct(
            name, fields, tag=name, omit_defaults=True, gc=False, array_like=array_like
        )

    def event_types(array_like: bool) -> tuple[type, type, type]:
        return (
            event_type("BlockStored", stored_fields, array_like),
            event_type("BlockRemoved", removed_fields, array_like),
            event_type("AllBlocksCleared", [], array_like),
        )

    class Structs:
        ValidationError = msgspec.ValidationError
        DecodeError = msgspec.DecodeError
        encoder = msgspec.msgpack.Encoder()
        decode_any = staticmethod(msgspec.msgpack.decode)
        convert = staticmethod(msgspec.convert)
        map_types = event_types(array_like=False)
        array_types = event_types(array_like=True)

    return Structs


def _int64_hashes(block_hashes: list) -> list:
    # Hot path: one comprehension, no call per hash; the low 64 bits of a digest are its last
    # 8 bytes read big-endian. Hashes already external (decoded events) pass through.
    from_bytes = int.from_bytes
    return [from_bytes(h[-_LOW_64_BITS:], "big") if type(h) is bytes else h for h in block_hashes]


def _same_hashes(block_hashes: list) -> list:
    return block_hashes


class EventEncoder:
    """Encode `EventBatch`es (in-process events with digest hashes, or decoded ones).

    Args:
        layout: "map" (the reference's tagged maps, default) or "array" (legacy arrays).
        hash_format: "int64" (low 64 bits as an unsigned int, the reference default) or
            "bytes" (the full digest).
        include_schema_version: append the extension map `{"schema_version": 1}`. Off by
            default so the bytes equal the reference's; snapshots always carry it.
    """

    def __init__(
        self,
        layout: Layout = "map",
        hash_format: HashFormat = "int64",
        include_schema_version: bool = False,
    ) -> None:
        if layout not in ("map", "array"):
            raise InvalidArgumentError(f"layout must be 'map' or 'array', got {layout!r}")
        if hash_format not in ("int64", "bytes"):
            raise InvalidArgumentError(
                f"hash_format must be 'int64' or 'bytes', got {hash_format!r}"
            )
        structs = _structs()
        self.layout = layout
        self.hash_format = hash_format
        self.include_schema_version = include_schema_version
        self._use_int = hash_format == "int64"
        self._convert = _int64_hashes if self._use_int else _same_hashes
        self._encode = structs.encoder.encode
        types = structs.map_types if layout == "map" else structs.array_types
        self._stored, self._removed, self._cleared = types

    def encode(self, batch: EventBatch) -> bytes:
        """Serialize one batch; raises `InvalidArgumentError` naming an unknown event type."""
        events = [self._to_struct(event) for event in batch.events]
        fields: list[Any] = [float(batch.ts), events, batch.data_parallel_rank]
        if batch.snapshot_next_seq is not None:
            fields.append(
                {"schema_version": SCHEMA_VERSION, "snapshot_next_seq": batch.snapshot_next_seq}
            )
        elif self.include_schema_version:
            fields.append({"schema_version": SCHEMA_VERSION})
        return self._encode(fields)

    def encode_events(
        self, events: Sequence[KVCacheEvent], ts: float, data_parallel_rank: int | None = None
    ) -> bytes:
        return self.encode(EventBatch(ts, list(events), data_parallel_rank))

    def _to_struct(self, event: KVCacheEvent) -> Any:
        convert = self._convert
        # `type(event) is`, not isinstance: exact types, and mypy narrows on it.
        if type(event) is BlockStored:
            parent = event.parent_block_hash
            return self._stored(
                convert(event.block_hashes),
                None if parent is None else convert([parent])[0],
                event.token_ids,
                event.block_size,
                event.lora_id,
                event.medium,
                event.lora_name,
                event.extra_keys,
                event.group_idx,
                event.kv_cache_spec_kind,
                event.kv_cache_spec_sliding_window,
                event.locality,
                event.ownership,
                event.session_id,
                event.lookahead_token_ids,
            )
        if type(event) is BlockRemoved:
            return self._removed(
                convert(event.block_hashes),
                event.medium,
                event.group_idx,
                event.locality,
                event.ownership,
            )
        if type(event) is AllBlocksCleared:
            return self._cleared()
        raise InvalidArgumentError(f"cannot encode {event!r}: not a KV-cache event")


def _tupleize(value: Any) -> Any:
    """msgpack has no tuples: turn decoded extra keys back into the tuples the producer had."""
    if type(value) is list:
        return tuple(_tupleize(item) for item in value)
    return value


class EventDecoder:
    """Decode batches in every layout: tagged maps or legacy arrays (per event), int or bytes
    hashes, with or without `dp_rank` and the extension map.

    Events of an unknown type are skipped and counted in `num_unknown_events` (forward
    compatibility). Anything else malformed raises `WireFormatError` for the whole batch, so a
    consumer never applies half a batch.
    """

    def __init__(self) -> None:
        structs = _structs()
        self._decode_any = structs.decode_any
        self._convert = structs.convert
        self._errors = (structs.ValidationError, structs.DecodeError)
        stored_map, removed_map, cleared_map = structs.map_types
        stored_arr, removed_arr, cleared_arr = structs.array_types
        self._map_types = {
            "BlockStored": stored_map,
            "BlockRemoved": removed_map,
            "AllBlocksCleared": cleared_map,
        }
        self._array_types = {
            "BlockStored": stored_arr,
            "BlockRemoved": removed_arr,
            "AllBlocksCleared": cleared_arr,
        }
        self.num_unknown_events = 0

    def decode(self, payload: bytes | bytearray | memoryview) -> EventBatch:
        """Decode one batch; any malformed payload raises `WireFormatError`."""
        try:
            return self._decode(payload)
        except RecursionError as exc:  # msgspec and extra keys recurse per nesting level
            raise WireFormatError("payload nests deeper than the decoder allows") from exc

    def _decode(self, payload: bytes | bytearray | memoryview) -> EventBatch:
        try:
            raw = self._decode_any(payload)
        except self._errors as exc:
            raise WireFormatError(f"payload is not valid msgpack: {exc}") from exc
        if type(raw) is not list or not 2 <= len(raw) <= 16:
            raise WireFormatError(
                f"a batch is an array [ts, events, dp_rank?, ext?], got {type(raw).__name__}"
                + (f" of length {len(raw)}" if type(raw) is list else "")
            )
        ts, raw_events = raw[0], raw[1]
        if type(ts) not in (int, float):
            raise WireFormatError(f"batch ts must be a number, got {ts!r}")
        if type(raw_events) is not list:
            raise WireFormatError(f"batch events must be an array, got {type(raw_events).__name__}")
        dp_rank = raw[2] if len(raw) > 2 else None
        if dp_rank is not None and type(dp_rank) is not int:
            raise WireFormatError(f"batch dp_rank must be an int or nil, got {dp_rank!r}")
        schema_version = snapshot_next_seq = None
        if len(raw) > 3 and type(raw[3]) is dict:
            ext = raw[3]
            schema_version = ext.get("schema_version")
            snapshot_next_seq = ext.get("snapshot_next_seq")
            if schema_version is not None and type(schema_version) is not int:
                raise WireFormatError(f"schema_version must be an int, got {schema_version!r}")
            if snapshot_next_seq is not None and (
                type(snapshot_next_seq) is not int or snapshot_next_seq < 0
            ):
                raise WireFormatError(
                    f"snapshot_next_seq must be an int >= 0, got {snapshot_next_seq!r}"
                )
        events: list[KVCacheEvent] = []
        for index, raw_event in enumerate(raw_events):
            event = self._decode_event(raw_event, index)
            if event is not None:
                events.append(event)
        return EventBatch(float(ts), events, dp_rank, schema_version, snapshot_next_seq)

    def _decode_event(self, raw_event: Any, index: int) -> KVCacheEvent | None:
        if type(raw_event) is dict:
            tag = raw_event.get("type")
            struct_type = self._map_types.get(tag) if type(tag) is str else None
        elif type(raw_event) is list and raw_event:
            tag = raw_event[0]
            struct_type = self._array_types.get(tag) if type(tag) is str else None
            padding = _LEGACY_PADDING.get(tag, 0) if type(tag) is str else 0
            if padding and len(raw_event) < padding:
                # Older producers predate `lora_id`, `medium` and `lora_name`: read them as nil.
                raw_event = raw_event + [None] * (padding - len(raw_event))
        else:
            raise WireFormatError(f"event {index} is neither a tagged map nor a tagged array")
        if struct_type is None:
            if type(tag) is not str:
                raise WireFormatError(f"event {index} has no type tag")
            self.num_unknown_events += 1
            return None
        try:
            value = self._convert(raw_event, struct_type)
        except self._errors as exc:
            raise WireFormatError(f"event {index} ({tag}) is malformed: {exc}") from exc
        if tag == "BlockStored":
            return BlockStored(
                block_hashes=value.block_hashes,
                parent_block_hash=value.parent_block_hash,
                token_ids=value.token_ids,
                block_size=value.block_size,
                lora_id=value.lora_id,
                medium=value.medium,
                lora_name=value.lora_name,
                extra_keys=(
                    None
                    if value.extra_keys is None
                    else [_tupleize(keys) for keys in value.extra_keys]
                ),
                group_idx=value.group_idx,
                kv_cache_spec_kind=value.kv_cache_spec_kind,
                kv_cache_spec_sliding_window=value.kv_cache_spec_sliding_window,
                locality=value.locality,
                ownership=value.ownership,
                session_id=value.session_id,
                lookahead_token_ids=value.lookahead_token_ids,
            )
        if tag == "BlockRemoved":
            return BlockRemoved(
                value.block_hashes, value.medium, value.group_idx, value.locality, value.ownership
            )
        return AllBlocksCleared()


def encode_batch(
    events: Iterable[KVCacheEvent],
    ts: float,
    data_parallel_rank: int | None = None,
    layout: Layout = "map",
    hash_format: HashFormat = "int64",
) -> bytes:
    """One-off encoding (builds an encoder; keep an `EventEncoder` for repeated use)."""
    batch = EventBatch(ts, list(events), data_parallel_rank)
    return EventEncoder(layout, hash_format).encode(batch)


def decode_batch(payload: bytes) -> EventBatch:
    """One-off decoding (builds a decoder; keep an `EventDecoder` for repeated use)."""
    return EventDecoder().decode(payload)
