"""sha256_cbor's own encoder: byte-identical to cbor2's canonical encoding, hashes identical.

`encode_token_blocks` builds the token arrays of block payloads without cbor2; cbor2 is the
reference for every byte. The request hasher's results must equal the reference formula
`sha256(cbor2.dumps((parent, tuple(tokens), None), canonical=True))` on every path (the
vectorized one for long runs, cbor2 per block for short runs, bools and huge ids).
"""

from __future__ import annotations

import hashlib
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import Request, make_request_block_hasher
from pagedkv.canonical_cbor import MAX_VECTOR_TOKEN_ID, cbor_head, encode_token_blocks
from pagedkv.errors import InvalidTypeError
from pagedkv.hashing import CBOR_VECTOR_MIN_BLOCKS, pack_token_ids

cbor2 = pytest.importorskip("cbor2")

# Every boundary of CBOR's unsigned-integer forms (1, 2, 3 and 5 bytes), and of our encoder's.
BOUNDARIES = [0, 1, 2, 23, 24, 25, 255, 256, 257, 65535, 65536, 65537]
BOUNDARIES += [MAX_VECTOR_TOKEN_ID - 1, MAX_VECTOR_TOKEN_ID]
token_ids = st.one_of(
    st.sampled_from(BOUNDARIES), st.integers(0, MAX_VECTOR_TOKEN_ID), st.integers(0, 300)
)


def reference_tails(tokens: list, block_size: int) -> list[bytes]:
    return [
        cbor2.dumps(tuple(tokens[start : start + block_size]), canonical=True) + b"\xf6"
        for start in range(0, len(tokens), block_size)
    ]


def reference_hashes(tokens: list, block_size: int, parent: bytes) -> list[bytes]:
    hashes = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        payload = (parent, tuple(tokens[start : start + block_size]), None)
        parent = hashlib.sha256(cbor2.dumps(payload, canonical=True)).digest()
        hashes.append(parent)
    return hashes


@settings(max_examples=60, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 16, 23, 24, 255, 256]),
    data=st.data(),
)
def test_token_blocks_are_cbor2_bytes(block_size, data):
    num_blocks = data.draw(st.integers(1, 3))
    tokens = data.draw(
        st.lists(token_ids, min_size=num_blocks * block_size, max_size=num_blocks * block_size)
    )
    assert encode_token_blocks(pack_token_ids(tokens), tokens, block_size) == reference_tails(
        tokens, block_size
    )


@pytest.mark.parametrize("block_size", [16, 64])
def test_whole_payload_is_cbor2_bytes(block_size):
    rng = random.Random(block_size)
    tokens = [rng.choice(BOUNDARIES) for _ in range(8 * block_size)]
    parent = hashlib.sha256(b"parent").digest()
    tails = encode_token_blocks(pack_token_ids(tokens), tokens, block_size)
    for index, tail in enumerate(tails):
        block = tuple(tokens[index * block_size : (index + 1) * block_size])
        payload = cbor_head(4, 3) + cbor_head(2, len(parent)) + parent + tail
        assert payload == cbor2.dumps((parent, block, None), canonical=True)


@pytest.mark.parametrize("value", [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**64 - 1])
def test_heads_are_cbor2_heads(value):
    assert cbor_head(0, value) == cbor2.dumps(value)


def test_bools_and_huge_ids_are_left_to_cbor2():
    tokens = [5] * 15 + [True]
    assert encode_token_blocks(pack_token_ids(tokens), tokens, 16) is None
    tokens = [5] * 15 + [MAX_VECTOR_TOKEN_ID + 1]
    assert encode_token_blocks(pack_token_ids(tokens), tokens, 16) is None
    # A plain 1 where a bool could be is encoded (as cbor2 would: the integer 1).
    tokens = [5] * 15 + [1]
    assert encode_token_blocks(pack_token_ids(tokens), tokens, 16) == reference_tails(tokens, 16)


@pytest.mark.parametrize("vocab", [300, 32000, 128256, 2**32])
def test_request_hashes_equal_the_reference_formula(vocab):
    """Every path of the request hasher: a long prompt, short appends and one long append."""
    rng = random.Random(vocab)
    hasher = make_request_block_hasher(16, "sha256_cbor")
    root = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    prompt = [
        rng.choice(BOUNDARIES) if rng.random() < 0.2 else rng.randrange(vocab)
        for _ in range(16 * (CBOR_VECTOR_MIN_BLOCKS + 3) + 5)
    ]
    request = Request("r", prompt, block_hasher=hasher)
    assert request.block_hashes == reference_hashes(prompt, 16, root)
    for _ in range(40):  # one token at a time: one block per hasher call
        request.append_output_token_ids(rng.randrange(vocab))
    long_append = [rng.randrange(vocab) for _ in range(16 * CBOR_VECTOR_MIN_BLOCKS + 7)]
    request.append_output_token_ids(long_append)
    assert request.block_hashes == reference_hashes(request.all_token_ids, 16, root)


def test_bool_tokens_encode_as_cbor2_does_and_a_request_refuses_them():
    # The encoder leaves bools to cbor2 (CBOR true, not 1) for direct callers...
    tokens = [7, 8, True, 9]
    assert encode_token_blocks(pack_token_ids(tokens), tokens, 4) is None
    assert reference_tails(tokens, 4) != reference_tails([7, 8, 1, 9], 4)
    # ...while a Request refuses them, as the trace loader does (issue 24).
    hasher = make_request_block_hasher(4, "sha256_cbor")
    with pytest.raises(InvalidTypeError, match=r"position 2 is True \(bool\)"):
        Request("r", [*tokens, *range(300, 320)], block_hasher=hasher)
