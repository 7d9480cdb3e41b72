"""Leaf: the token arrays of sha256_cbor block payloads, in canonical CBOR, built in C.

sha256_cbor hashes cbor2's canonical encoding of `(parent, tuple(token_ids), None)` per block.
Encoding a long prompt one cbor2 call per block costs more than the hashing itself, so
`encode_token_blocks` encodes every block of a packed prompt with a fixed number of C-level
bytes operations. Only that shape: cbor2 stays the reference (the tests compare bytes) and
encodes everything else (extra keys, ids of 2**24 and above, bools).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.errors import InvalidArgumentError

CBOR_NONE = b"\xf6"
MAX_VECTOR_TOKEN_ID = (1 << 24) - 1  # larger ids take the reference encoder


def cbor_head(major_type: int, value: int) -> bytes:
    """A canonical CBOR item head: the major type and the shortest form of `value`."""
    if value < 24:
        return bytes([major_type << 5 | value])
    for extra, num_bytes in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * num_bytes):
            return bytes([major_type << 5 | extra]) + value.to_bytes(num_bytes, "big")
    raise InvalidArgumentError(f"{value} does not fit a CBOR head")


def _table(function: Callable[[int], int]) -> bytes:
    return bytes(function(byte) for byte in range(256))


# A token id `v < 2**24` in canonical CBOR is `v` (below 24), `18 v` (below 256), `19 hi lo`
# (below 65536) or `1a 00 b2 hi lo`. Each token gets five UTF-16 code units, one per byte of
# the longest form, [head, 00, b2, hi, lo]; a unit not in the token's form is U+0100, which
# encoding to Latin-1 with errors="ignore" drops. Class flags per token: 4 if b2, 2 if hi, 1
# if lo >= 24; the highest set flag is the form.
_FLAG_B2 = _table(lambda byte: 4 if byte else 0)
_FLAG_HI = _table(lambda byte: 2 if byte else 0)
_FLAG_LO = _table(lambda byte: 1 if byte >= 24 else 0)


def _form(flags: int) -> int:
    return 3 if flags & 4 else 2 if flags & 2 else 1 if flags & 1 else 0


# By flags: the head byte (none for the one-byte form, where `lo` is the value) ...
_HEAD = _table(lambda flags: (0, 0x18, 0x19, 0x1A)[_form(flags)] if flags < 8 else 0)
_HEAD_DROPPED = _table(lambda flags: 1 if flags < 8 and _form(flags) == 0 else 0)
# ... and whether units 1-2 (`00 b2`) and unit 3 (`hi`) are dropped.
_B2_DROPPED = _table(lambda flags: 0 if flags < 8 and _form(flags) == 3 else 1)
_HI_DROPPED = _table(lambda flags: 0 if flags < 8 and _form(flags) >= 2 else 1)
# Token values 0 and 1 (a bool packs as one of them): checked for bools, which cbor2 encodes
# as CBOR true/false.
_IS_0_OR_1 = _table(lambda byte: 1 if byte < 2 else 0)
_IS_ZERO = _table(lambda byte: 1 if byte == 0 else 0)
_BLOCK_END = "\u0101"


def encode_token_blocks(
    packed: bytes, token_ids: Sequence[int], block_size: int
) -> list[bytes] | None:
    """Per block of `block_size` tokens, the canonical CBOR of its token-id array and a null.

    Block j's result is `cbor2.dumps(tuple(block_j), canonical=True) + b"\\xf6"`: what
    follows the parent in the block's payload. `packed` is `pack_token_ids(token_ids)` (little-
    endian uint32) and holds whole blocks. Returns None, for the caller to use cbor2, if an id
    is above `MAX_VECTOR_TOKEN_ID` or a token is a bool.
    """
    num_tokens = len(packed) // 4
    if packed[3::4].count(0) != num_tokens:
        return None  # an id of 2**24 or more
    lo, hi, b2 = packed[0::4], packed[1::4], packed[2::4]
    from_bytes = int.from_bytes
    flags = (
        from_bytes(b2.translate(_FLAG_B2), "little")
        | from_bytes(hi.translate(_FLAG_HI), "little")
        | from_bytes(lo.translate(_FLAG_LO), "little")
    ).to_bytes(num_tokens, "little")
    if _has_bool(flags, lo, token_ids):
        return None
    b2_dropped = flags.translate(_B2_DROPPED)
    # Hot path: six UTF-16 units (twelve bytes) per token, filled by strided slice assignments;
    # unit 5 ends a block (U+0101) or is dropped.
    units = bytearray(12 * num_tokens)
    units[0::12] = flags.translate(_HEAD)
    units[1::12] = flags.translate(_HEAD_DROPPED)
    units[3::12] = b2_dropped
    units[4::12] = b2
    units[5::12] = b2_dropped
    units[6::12] = hi
    units[7::12] = flags.translate(_HI_DROPPED)
    units[8::12] = lo
    units[10::12] = (bytes(block_size - 1) + b"\x01") * (num_tokens // block_size)
    units[11::12] = b"\x01" * num_tokens
    blocks = units.decode("utf-16-le").split(_BLOCK_END)
    blocks.pop()  # after the last block's end
    array_head = cbor_head(4, block_size)
    # Latin-1 has no U+0100: "ignore" drops every dropped unit while encoding.
    return [array_head + block.encode("latin-1", "ignore") + CBOR_NONE for block in blocks]


def _has_bool(flags: bytes, lo: bytes, token_ids: Sequence[int]) -> bool:
    """Whether a token valued 0 or 1 (no flag, lo < 2) is a bool; looks only at those."""
    from_bytes = int.from_bytes
    small = from_bytes(flags.translate(_IS_ZERO), "little") & from_bytes(
        lo.translate(_IS_0_OR_1), "little"
    )
    if not small:
        return False
    positions = small.to_bytes(len(lo), "little")
    position = positions.find(1)
    while position >= 0:
        if type(token_ids[position]) is bool:
            return True
        position = positions.find(1, position + 1)
    return False
