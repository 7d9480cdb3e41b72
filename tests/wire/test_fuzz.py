"""Fuzzing the wire decoder (issue 11 item 8): arbitrary bytes, arbitrary msgpack values and
batch-shaped values with arbitrary fields each give an `EventBatch` or a `WireFormatError`,
never another exception, and decoding allocates memory in proportion to the payload."""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

msgspec = pytest.importorskip("msgspec")

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from pagedkv.wire import EventBatch, EventDecoder, EventEncoder, WireFormatError  # noqa: E402

DECODER = EventDecoder()
FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Peak allocation allowed while decoding: proportional to the payload, plus a fixed slack.
BYTES_PER_PAYLOAD_BYTE = 64
SLACK_BYTES = 256 * 1024

msgpack_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
)
msgpack_values = st.recursive(
    msgpack_scalars,
    lambda children: (
        st.lists(children, max_size=6)
        | st.dictionaries(st.text(max_size=12) | st.integers(-5, 5), children, max_size=6)
    ),
    max_leaves=40,
)
small_values = st.recursive(
    msgpack_scalars, lambda children: st.lists(children, max_size=3), max_leaves=6
)
EVENT_KEYS = (
    "type block_hashes parent_block_hash token_ids block_size lora_id medium lora_name "
    "extra_keys group_idx kv_cache_spec_kind kv_cache_spec_sliding_window locality ownership "
    "session_id"
).split()
event_types = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
map_events = st.builds(
    lambda tag, fields: {"type": tag, **fields},
    event_types,
    st.dictionaries(st.sampled_from(EVENT_KEYS[1:]), small_values, max_size=8),
)
array_events = st.builds(
    lambda tag, rest: [tag, *rest], event_types, st.lists(msgpack_values, max_size=15)
)
batch_shaped = st.builds(
    lambda ts, events, tail: [ts, events, *tail],
    msgpack_scalars,
    st.lists(map_events | array_events | msgpack_values, max_size=5),
    st.lists(
        msgpack_values
        | st.dictionaries(st.sampled_from(["schema_version", "snapshot_next_seq"]), msgpack_values),
        max_size=3,
    ),  # fmt: skip
)


def decode_checked(payload: bytes) -> EventBatch | None:
    """Decode; only a batch or WireFormatError may come out, within the memory bound."""
    tracemalloc.start()
    try:
        batch = DECODER.decode(payload)
    except WireFormatError:
        batch = None
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak <= SLACK_BYTES + BYTES_PER_PAYLOAD_BYTE * len(payload), (peak, len(payload))
    if batch is not None:
        assert isinstance(batch, EventBatch)
        for event in batch.events:
            assert type(event) in (BlockStored, BlockRemoved, AllBlocksCleared)
    return batch


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes(payload):
    decode_checked(payload)


@FUZZ
@given(msgpack_values)
def test_arbitrary_msgpack_values(value):
    decode_checked(msgspec.msgpack.encode(value))


@settings(FUZZ, max_examples=50)  # generating these dominates the time
@given(batch_shaped)
def test_batch_shaped_values_with_arbitrary_fields(value):
    decode_checked(msgspec.msgpack.encode(value))


@FUZZ
@given(st.data())
def test_mutated_valid_batches(data):
    stored = BlockStored(
        [1, 2**64 - 1], None, [1, 2, 3, 4, 5, 6, 7, 8], 4, None, "GPU", group_idx=0
    )
    payload = bytearray(
        EventEncoder(data.draw(st.sampled_from(["map", "array"]))).encode(
            EventBatch(1.5, [stored, BlockRemoved([1], "GPU", 0), AllBlocksCleared()], 0)
        )
    )
    for _ in range(data.draw(st.integers(1, 4))):
        position = data.draw(st.integers(0, len(payload) - 1))
        payload[position] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(payload)))
    decode_checked(bytes(payload[:cut]))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xdd\xff\xff\xff\xff",  # an array header claiming 4 G elements
        b"\xdf\xff\xff\xff\xff",  # a map claiming 4 G entries
        b"\xc6\xff\xff\xff\xff",  # 4 GiB of bin
        b"\x91" * 100_000 + b"\xc0",  # nested 100,000 deep
        b"\x92\x01\x91\x82\xa4type\xabBlockStored\xaaextra_keys" + b"\x91" * 3000 + b"\xc0",
    ],
    ids=["huge-array", "huge-map", "huge-bin", "deep-nesting", "deep-extra-keys"],
)
def test_hostile_headers_and_nesting_are_refused_cheaply(payload):
    assert decode_checked(payload) is None
