"""The Triton kernels (Triton's interpreter on CPU) against the reference backend.

Random ragged batches (prefill chunks after cached prefixes, whole prompts, decodes), block
sizes, GQA groups, head sizes that are not powers of two, sliding windows, split-K decode;
the KV write with padding slots. Shapes stay small: the interpreter runs each program in Python.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from tests.support.engine import require_triton  # noqa: E402

require_triton()

from pagedkv.engine import triton_attention  # noqa: E402
from pagedkv.engine.attention import paged_attention_reference  # noqa: E402
from pagedkv.engine.attention_metadata import build_attention_metadata  # noqa: E402
from pagedkv.engine.paged_kv import NULL_BLOCK_ID, PAD_SLOT_ID, write_kv_torch  # noqa: E402
from pagedkv.engine.triton_attention import (  # noqa: E402
    KernelTiles,
    choose_tiles,
    paged_attention_triton,
    write_kv_triton,
)

pytestmark = pytest.mark.torch

NUM_BLOCKS = 48


def random_step(rng: random.Random, block_size: int, kv_shape: tuple[int, int], kinds: str):
    """A pool with each sequence's cached K/V written, and a step over it.

    `kinds` has one letter a sequence: `p` a whole prompt, `e` a chunk after a cached prefix,
    `d` one decode token. Block ids are drawn at random from the pool (never the null block).
    """
    num_kv_heads, head_dim = kv_shape
    kv = torch.zeros(NUM_BLOCKS, 2, block_size, num_kv_heads, head_dim)
    free = list(range(1, NUM_BLOCKS))
    rng.shuffle(free)
    tables, num_computed, num_new = [], [], []
    for kind in kinds:
        computed = 0 if kind == "p" else rng.randint(1, 37)
        new = 1 if kind == "d" else rng.randint(2, 19)
        table = [free.pop() for _ in range(-(-(computed + new) // block_size))]
        full = build_attention_metadata([table], [0], [computed + new], block_size)
        keys, values = torch.randn(2, computed + new, num_kv_heads, head_dim)
        write_kv_torch(kv, keys, values, full.slot_mapping)
        tables.append(table)
        num_computed.append(computed)
        num_new.append(new)
    return kv, build_attention_metadata(tables, num_computed, num_new, block_size)


CASES = [
    # block size, kv heads, group, head dim, window, kinds
    (16, 2, 4, 32, None, "epd"),
    (4, 1, 3, 24, None, "pe"),
    (1, 2, 1, 8, 5, "ed"),
    (16, 1, 2, 16, 7, "pdde"),
    (8, 2, 4, 16, 20, "e"),
]


@pytest.mark.parametrize("case", CASES)
def test_ragged_batches_match_the_reference(case):
    block_size, num_kv_heads, group, head_dim, window, kinds = case
    rng = random.Random(f"{block_size}{kinds}")
    torch.manual_seed(block_size)
    kv, metadata = random_step(rng, block_size, (num_kv_heads, head_dim), kinds)
    query = torch.randn(metadata.num_tokens, num_kv_heads * group, head_dim)
    scale = head_dim**-0.5
    expected = paged_attention_reference(query, kv, metadata, scale, window)
    out = paged_attention_triton(query, kv, metadata, scale, window)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 9])
def test_split_k_decode_matches_the_reference_with_empty_splits(window):
    # 4 splits of 16-key tiles over sequences of 2..40 keys: some splits get no tile at all.
    rng = random.Random(11)
    torch.manual_seed(11)
    kv, metadata = random_step(rng, 4, (2, 16), "dddd")
    query = torch.randn(metadata.num_tokens, 8, 16)
    tiles = KernelTiles(1, 16, 16, 4, num_warps=4, num_stages=1)
    expected = paged_attention_reference(query, kv, metadata, 0.25, window)
    out = paged_attention_triton(query, kv, metadata, 0.25, window, tiles=tiles)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_pool_matches_the_reference_within_rounding():
    rng = random.Random(5)
    torch.manual_seed(5)
    kv, metadata = random_step(rng, 16, (2, 32), "ed")
    kv = kv.bfloat16()
    query = torch.randn(metadata.num_tokens, 8, 32).bfloat16()
    expected = paged_attention_reference(query, kv, metadata, 32**-0.5, None)
    out = paged_attention_triton(query, kv, metadata, 32**-0.5, None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=0.02, atol=0.02)


def test_write_skips_padding_slots_and_matches_the_torch_write():
    metadata = build_attention_metadata([[5, 3], [7]], [0, 2], [6, 1], 4)
    slots = torch.cat([metadata.slot_mapping, torch.tensor([PAD_SLOT_ID, PAD_SLOT_ID])])
    keys, values = torch.randn(2, 9, 3, 12)
    ours = torch.zeros(10, 2, 4, 3, 12)
    write_kv_triton(ours, keys, values, slots)
    expected = torch.zeros_like(ours)
    write_kv_torch(expected, keys[:7], values[:7], metadata.slot_mapping)
    assert torch.equal(ours, expected)
    assert not ours[NULL_BLOCK_ID].any() and not ours[9].any()  # pads wrote nowhere
    assert torch.equal(ours[7, 1, 2], values[6])  # sequence 1's decode token: block 7, slot 2


def test_decode_tiles_split_only_when_the_batch_cannot_fill_the_device(monkeypatch):
    monkeypatch.setattr(triton_attention, "_num_programs_wanted", lambda device: 528)
    cpu = torch.device("cpu")

    def tiles(num_seqs: int, seq_len: int, num_new: int = 1) -> KernelTiles:
        tables = [[1] * -(-seq_len // 16)] * num_seqs
        metadata = build_attention_metadata(tables, [seq_len - num_new] * num_seqs,
                                            [num_new] * num_seqs, 16)  # fmt: skip
        return choose_tiles(metadata, 32, 8, cpu)

    assert tiles(16, 32768).num_splits == 8  # 128 programs -> 5 wanted, rounded up to 8
    assert tiles(64, 4096).num_splits == 2
    assert tiles(256, 1024).num_splits == 1
    assert tiles(1, 300).num_splits == 1  # 300 keys: not worth a split
    prefill = tiles(2, 100, num_new=50)
    assert (prefill.num_splits, prefill.block_q * prefill.rows_per_token) == (1, 64)


def test_graph_buckets_and_decode_packing():
    from pagedkv.engine.cuda_graphs import _pack_decode, default_buckets
    from pagedkv.errors import InvalidArgumentError

    assert default_buckets(1) == (1,)
    assert default_buckets(40) == (1, 2, 4, 8, 16, 32, 40)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 48, 64)
    # Two real sequences (14 and 10 tokens, block size 4) and two padding sequences, each
    # holding one key in the null block: [query_start_loc | seq_lens | starts | block ids].
    packed = _pack_decode([[3, 4, 5, 6], [7, 8, 9, 11]], [14, 10], 4, 2)
    assert packed.tolist() == [0, 1, 2, 3, 4] + [14, 10, 1, 1] + [0, 4, 7, 8, 9] + [
        3, 4, 5, 6, 7, 8, 9, 0, 0,
    ]  # fmt: skip
    with pytest.raises(InvalidArgumentError, match="no real block for token 9"):
        _pack_decode([[7, 8, 0]], [10], 4, 0)


def test_triton_imported_before_pagedkv_without_a_gpu_is_a_clear_error():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (
        "import torch, triton\n"
        "assert not torch.cuda.is_available()\n"
        "from pagedkv.errors import ConfigError\n"
        "try:\n"
        "    from pagedkv.engine import triton_kernels\n"
        "except ConfigError as exc:\n"
        "    print(exc)\n"
    )
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the kernels compile")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "triton was imported before pagedkv could select its interpreter" in result.stdout
    assert "TRITON_INTERPRET=1" in result.stdout
