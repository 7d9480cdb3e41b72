"""Wire format: golden bytes against the reference's Struct definitions, every layout, round
trips from a real manager, and malformed payloads."""

from __future__ import annotations

import struct
from typing import Any

import pytest

msgspec = pytest.importorskip("msgspec")

from pagedkv import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)
from pagedkv.block import to_external_hash  # noqa: E402
from pagedkv.wire import (  # noqa: E402
    SCHEMA_VERSION,
    EventBatch,
    EventDecoder,
    EventEncoder,
    WireFormatError,
    decode_batch,
    encode_batch,
)

# --------------------------------------------------------------------------- reference Structs
# Written from vLLM 0.33's vllm/distributed/kv_events.py (field order and defaults; 0.33 added
# `lookahead_token_ids`), independently of pagedkv.wire.

Hash = int | bytes


class RefEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class RefBlockStored(RefEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class RefBlockRemoved(RefEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class RefAllBlocksCleared(RefEvent, tag="AllBlocksCleared"):
    pass


class RefEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[RefBlockStored | RefBlockRemoved | RefAllBlocksCleared]
    data_parallel_rank: int | None = None


# The legacy layout: the same events, array_like.
class RefArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class RefArrayBlockStored(RefArrayEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class RefArrayBlockRemoved(RefArrayEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class RefArrayAllBlocksCleared(RefArrayEvent, tag="AllBlocksCleared"):
    pass


class RefArrayEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[RefArrayBlockStored | RefArrayBlockRemoved | RefArrayAllBlocksCleared]
    data_parallel_rank: int | None = None


D1 = bytes(range(32))  # digests as the pool holds them
D2 = bytes(range(100, 132))
D3 = bytes([0xFF] * 32)


def known_events() -> list:
    return [
        BlockStored(
            block_hashes=[D1, D2],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        BlockStored(
            block_hashes=[D3],
            parent_block_hash=D2,
            token_ids=[5, 6],
            block_size=2,
            lora_id=7,
            medium="GPU",
            lora_name="adapter",
            extra_keys=[("adapter", "salt")],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=4,
            session_id="s1",
            lookahead_token_ids=[[7]],
        ),
        BlockRemoved(block_hashes=[D1], medium="GPU", group_idx=0, locality="LOCAL"),
        AllBlocksCleared(),
    ]


def reference_events(use_int: bool, array: bool) -> list:
    def h(digest: bytes) -> Hash:
        return to_external_hash(digest, use_int)

    stored, removed, cleared = (
        (RefArrayBlockStored, RefArrayBlockRemoved, RefArrayAllBlocksCleared)
        if array
        else (RefBlockStored, RefBlockRemoved, RefAllBlocksCleared)
    )
    return [
        stored(
            [h(D1), h(D2)],
            None,
            [1, 2, 3, 4],
            2,
            None,
            "GPU",
            None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        ),
        stored(
            [h(D3)],
            h(D2),
            [5, 6],
            2,
            7,
            "GPU",
            "adapter",
            extra_keys=[("adapter", "salt")],
            group_idx=1,
            kv_cache_spec_kind="sliding_window",
            kv_cache_spec_sliding_window=4,
            session_id="s1",
            lookahead_token_ids=[[7]],
        ),
        removed([h(D1)], "GPU", group_idx=0, locality="LOCAL"),
        cleared(),
    ]


@pytest.mark.parametrize("dp_rank", [None, 3])
@pytest.mark.parametrize("hash_format", ["int64", "bytes"])
@pytest.mark.parametrize("layout", ["map", "array"])
def test_golden_bytes_match_reference_structs(layout, hash_format, dp_rank):
    use_int = hash_format == "int64"
    batch_type = RefArrayEventBatch if layout == "array" else RefEventBatch
    expected = msgspec.msgpack.encode(
        batch_type(1700000000.25, reference_events(use_int, layout == "array"), dp_rank)
    )
    encoder = EventEncoder(layout=layout, hash_format=hash_format)
    actual = encoder.encode(EventBatch(1700000000.25, known_events(), dp_rank))
    assert actual == expected


def test_golden_bytes_literal_small_batch():
    # Hand-assembled msgpack, independent of msgspec's Struct machinery.
    payload = encode_batch([BlockRemoved([D1], "GPU", 0), AllBlocksCleared()], ts=2.0)
    low64 = int.from_bytes(D1[-8:], "big")
    expected = (
        b"\x93\xcb"  # [ts, events, dp_rank], ts a float64
        + struct.pack(">d", 2.0)
        + b"\x92"
        + b"\x84\xa4type\xacBlockRemoved"
        + b"\xacblock_hashes\x91\xcf"
        + low64.to_bytes(8, "big")
        + b"\xa6medium\xa3GPU"
        + b"\xa9group_idx\x00"
        + b"\x81\xa4type\xb0AllBlocksCleared"
        + b"\xc0"  # dp_rank nil: msgspec writes every field of an array-like Struct
    )
    assert payload == expected


def test_reference_decoder_reads_our_extension_map():
    encoder = EventEncoder(include_schema_version=True)
    payload = encoder.encode(EventBatch(5.0, known_events(), None))
    assert msgspec.msgpack.decode(payload)[3] == {"schema_version": SCHEMA_VERSION}
    ref = msgspec.msgpack.Decoder(type=RefEventBatch).decode(payload)
    assert ref.ts == 5.0 and ref.data_parallel_rank is None
    assert [type(e).__name__ for e in ref.events] == [
        "RefBlockStored",
        "RefBlockStored",
        "RefBlockRemoved",
        "RefAllBlocksCleared",
    ]
    snapshot = encoder.encode(EventBatch(6.0, [AllBlocksCleared()], 1, snapshot_next_seq=41))
    ref = msgspec.msgpack.Decoder(type=RefEventBatch).decode(snapshot)
    assert ref.data_parallel_rank == 1 and len(ref.events) == 1


def expected_decoded(use_int: bool) -> list:
    out = known_events()
    for event in out:
        if isinstance(event, (BlockStored, BlockRemoved)):
            event.block_hashes = [to_external_hash(h, use_int) for h in event.block_hashes]
        if isinstance(event, BlockStored) and event.parent_block_hash is not None:
            event.parent_block_hash = to_external_hash(event.parent_block_hash, use_int)
    return out


@pytest.mark.parametrize("hash_format", ["int64", "bytes"])
@pytest.mark.parametrize("layout", ["map", "array"])
def test_decoder_reads_reference_payloads(layout, hash_format):
    use_int = hash_format == "int64"
    batch_type = RefArrayEventBatch if layout == "array" else RefEventBatch
    payload = msgspec.msgpack.encode(
        batch_type(9.5, reference_events(use_int, layout == "array"), 2)
    )
    batch = EventDecoder().decode(payload)
    assert batch.ts == 9.5 and batch.data_parallel_rank == 2
    assert batch.schema_version is None and not batch.is_snapshot
    assert batch.events == expected_decoded(use_int)


def test_decoder_reads_old_short_forms():
    # vLLM before data-parallel ranks: [ts, events]; before `medium`: 6-element arrays.
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [5, 6], None, [1, 2, 3, 4], 2, None], ["BlockRemoved", [5], "GPU"]]]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == [
        BlockStored([5, 6], None, [1, 2, 3, 4], 2, None, None),
        BlockRemoved([5], "GPU"),
    ]


def test_decoder_reads_extension_and_skips_unknown_events():
    payload = msgspec.msgpack.encode(
        [
            3,
            [
                {"type": "FutureEvent", "x": 1},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU", "locality": "local"},
            ],
            None,
            {"schema_version": 7, "snapshot_next_seq": 12, "future_key": True},
        ]
    )
    decoder = EventDecoder()
    batch = decoder.decode(payload)
    assert batch.ts == 3.0 and batch.schema_version == 7 and batch.snapshot_next_seq == 12
    assert batch.events == [BlockRemoved([1], "CPU", locality="local")]
    assert decoder.num_unknown_events == 1


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "not valid msgpack"),
        (msgspec.msgpack.encode({"ts": 1}), "a batch is an array"),
        (msgspec.msgpack.encode([1.0]), "length 1"),
        (msgspec.msgpack.encode(["x", []]), "ts must be a number"),
        (msgspec.msgpack.encode([1.0, {}]), "events must be an array"),
        (msgspec.msgpack.encode([1.0, [], "dp"]), "dp_rank"),
        (msgspec.msgpack.encode([1.0, [5]]), "event 0 is neither"),
        (msgspec.msgpack.encode([1.0, [{"block_hashes": [1]}]]), "no type tag"),
        (
            msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "medium": "GPU"}]]),
            "event 0 (BlockRemoved) is malformed",
        ),
        (
            msgspec.msgpack.encode(
                [
                    1.0,
                    [
                        {
                            "type": "BlockStored",
                            "block_hashes": [1],
                            "parent_block_hash": None,
                            "token_ids": ["a"],
                            "block_size": 2,
                            "lora_id": None,
                            "medium": "GPU",
                            "lora_name": None,
                        }
                    ],
                ]
            ),
            "malformed",
        ),
        (msgspec.msgpack.encode([1.0, [], None, {"snapshot_next_seq": -1}]), "snapshot_next_seq"),
    ],
)
def test_malformed_payloads_raise_wire_format_error(payload, message):
    with pytest.raises(WireFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        EventDecoder().decode(payload)


def test_encoder_rejects_bad_options_and_events():
    with pytest.raises(ValueError, match="layout"):
        EventEncoder(layout="json")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="hash_format"):
        EventEncoder(hash_format="hex")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a KV-cache event"):
        EventEncoder().encode(EventBatch(0.0, ["BlockStored"]))  # type: ignore[list-item]


def make_manager(num_blocks: int = 16) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=128, enable_kv_cache_events=True)


@pytest.mark.parametrize("hash_format", ["int64", "bytes"])
@pytest.mark.parametrize("layout", ["map", "array"])
def test_round_trip_of_real_manager_events(layout, hash_format):
    manager = make_manager()
    hasher = make_request_block_hasher(4)
    request = Request("r", list(range(13)), block_hasher=hasher)
    assert manager.allocate_slots(request, 13) is not None
    manager.free(request)
    manager.evict_blocks({1})
    assert manager.reset_prefix_cache()
    events = manager.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    encoder = EventEncoder(layout=layout, hash_format=hash_format, include_schema_version=True)
    batch = EventDecoder().decode(encoder.encode(EventBatch(4.0, events, 0)))
    use_int = hash_format == "int64"
    stored = batch.events[0]
    assert stored.block_hashes == [to_external_hash(h, use_int) for h in request.block_hashes[:3]]
    assert stored.token_ids == list(range(12)) and stored.block_size == 4
    assert stored.kv_cache_spec_kind == events[0].kv_cache_spec_kind
    assert batch.events[1] == BlockRemoved(
        [to_external_hash(request.block_hashes[0], use_int)], "GPU", 0
    )
    assert batch.schema_version == SCHEMA_VERSION and batch.data_parallel_rank == 0
    # Decoded events encode to the same bytes again (hashes already external).
    assert encoder.encode(batch) == encoder.encode(EventBatch(4.0, events, 0))


def test_block_stored_map_header_is_16_bit_as_vllm_033():
    # vLLM 0.33's BlockStored has 15 fields plus the tag: msgspec writes a map16 header
    # (0xde + 2-byte count of the keys present) even when few keys are present; 14-field
    # structs (0.32) fit a fixmap. Our encoder writes the same bytes.
    payload = encode_batch([known_events()[0]], ts=1.0)
    events_array = payload.index(b"\x91")  # the one-event array, after [ts ...
    assert payload[events_array + 1 : events_array + 4] == b"\xde\x00\x0a"  # 10 keys
    assert RefBlockStored.__struct_fields__[-1] == "lookahead_token_ids"
    decoded = decode_batch(
        EventEncoder(hash_format="bytes").encode(EventBatch(1.0, known_events(), None))
    )
    assert decoded.events[1].lookahead_token_ids == [[7]]
    assert decoded.events[2].locality == "LOCAL"
