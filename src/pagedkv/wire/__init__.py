"""Adapters for KV events on the wire (extra `[events]` for the codec's msgpack and the transport).

`codec`: batches in the reference's msgpack layout (msgspec, imported on first use).
`snapshot`: one producer's cache contents mirrored from its events (stdlib).
`transport`: publisher and subscriber over ZeroMQ (imports pyzmq; import it explicitly).
"""

from __future__ import annotations

from pagedkv.wire.codec import (
    SCHEMA_VERSION,
    EventBatch,
    EventDecoder,
    EventEncoder,
    WireFormatError,
    decode_batch,
    encode_batch,
)
from pagedkv.wire.snapshot import CacheKey, CacheMirror

__all__ = [
    "SCHEMA_VERSION",
    "CacheKey",
    "CacheMirror",
    "EventBatch",
    "EventDecoder",
    "EventEncoder",
    "WireFormatError",
    "decode_batch",
    "encode_batch",
]
