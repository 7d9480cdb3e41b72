"""Paged KV store and attention over block tables (torch engine adapter)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine.attention import (  # noqa: E402
    get_attention_backend,
    paged_attention_reference,
    paged_attention_sdpa,
)
from pagedkv.engine.attention_metadata import build_attention_metadata  # noqa: E402
from pagedkv.engine.paged_kv import PagedKVStore  # noqa: E402
from pagedkv.errors import ConfigError, InvalidArgumentError, InvariantViolation  # noqa: E402
from pagedkv.specs import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)

pytestmark = pytest.mark.torch

BLOCK_SIZE = 4
NUM_KV_HEADS = 2
HEAD_DIM = 8


def make_store(num_blocks: int = 16, num_layers: int = 1, dtype=torch.float32) -> PagedKVStore:
    spec = FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, 4 if dtype == torch.float32 else 2)
    layers = tuple(f"layer{i}" for i in range(num_layers))
    return PagedKVStore(KVCacheConfig(num_blocks, (KVCacheGroupSpec(layers, spec),)), dtype=dtype)


def test_store_shape_and_memory_follow_the_spec():
    store = make_store(num_blocks=10, num_layers=2)
    assert store.kv_caches["layer0"].shape == (10, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    page_size = FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, 4).page_size_bytes
    assert store.memory_bytes == 2 * 10 * page_size


def test_block_copies_copy_every_layers_page_in_order():
    store = make_store(num_blocks=6, num_layers=2)
    for layer, kv in store.kv_caches.items():
        for block_id in range(1, 6):
            kv[block_id].fill_(10 * block_id + int(layer[-1]))
    store.copy_blocks([(2, 4), (4, 5)])  # the second copy sees the first's result
    for layer, kv in store.kv_caches.items():
        layer_id = int(layer[-1])
        assert [int(kv[b].flatten()[0]) for b in range(1, 6)] == [
            10 + layer_id,
            20 + layer_id,
            30 + layer_id,
            20 + layer_id,
            20 + layer_id,
        ]
        assert bool((kv[4] == kv[2]).all())
    with pytest.raises(InvalidArgumentError, match="block 0 is not in"):
        store.copy_blocks([(0, 3)])
    with pytest.raises(InvalidArgumentError, match=r"block 6 is not in \[1, 6\)"):
        store.copy_blocks([(1, 6)])
    assert int(store.kv_caches["layer0"][3].flatten()[0]) == 30  # a refused call copies nothing


def test_store_rejects_mismatched_dtype_and_non_attention_specs():
    spec = FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, 2)
    config = KVCacheConfig(4, (KVCacheGroupSpec(("l",), spec),))
    with pytest.raises(ConfigError, match="dtype_bytes=2"):
        PagedKVStore(config, dtype=torch.float32)
    mamba = KVCacheConfig(4, (KVCacheGroupSpec(("m",), MambaSpec(1, ((4, 4),), 4)),))
    with pytest.raises(ConfigError, match="MambaSpec"):
        PagedKVStore(mamba)


def test_shared_kv_cache_tensors_alias_one_buffer():
    spec = FullAttentionSpec(BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, 4)
    groups = (KVCacheGroupSpec(("full",), spec), KVCacheGroupSpec(("swa",), spec))
    tensor = KVCacheTensor(6 * spec.page_size_bytes, ("full", "swa"))
    store = PagedKVStore(KVCacheConfig(6, groups, (tensor,)))
    assert store.memory_bytes == 6 * spec.page_size_bytes
    store.kv_caches["full"][3, 1, 2].fill_(7.0)
    assert torch.all(store.kv_caches["swa"][3, 1, 2] == 7.0)
    bad = KVCacheTensor(5 * spec.page_size_bytes, ("full", "swa"))
    with pytest.raises(ConfigError, match="does not hold 6 pages"):
        PagedKVStore(KVCacheConfig(6, groups, (bad,)))


def test_slot_mapping_and_positions_follow_block_tables():
    # Sequence 0: 5 computed, 3 new (positions 5..7 in block 9, offsets 1..3).
    # Sequence 1: 0 computed, 6 new (blocks 2 then 7).
    metadata = build_attention_metadata([[4, 9], [2, 7, 11]], [5, 0], [3, 6], BLOCK_SIZE)
    assert metadata.positions.tolist() == [5, 6, 7, 0, 1, 2, 3, 4, 5]
    assert metadata.slot_mapping.tolist() == [37, 38, 39, 8, 9, 10, 11, 28, 29]
    assert metadata.query_start_loc.tolist() == [0, 3, 9]
    assert metadata.seq_lens.tolist() == [8, 6]
    assert metadata.num_computed_tokens.tolist() == [5, 0]
    # CSR tables trimmed to the blocks each sequence reaches (2 each here).
    assert metadata.block_ids.tolist() == [4, 9, 2, 7]
    assert metadata.block_table_starts.tolist() == [0, 2, 4]
    assert (metadata.max_query_len, metadata.max_seq_len, metadata.max_num_blocks) == (6, 8, 2)
    # Padded for the gather backends with the null block.
    assert metadata.block_tables.tolist() == [[4, 9], [2, 7]]
    ragged = build_attention_metadata([[4, 9, 3], [2]], [9, 0], [1, 2], BLOCK_SIZE)
    assert ragged.block_tables.tolist() == [[4, 9, 3], [2, 0, 0]]
    assert metadata.padded_query_index.tolist() == [0, 1, 2, 6, 7, 8, 9, 10, 11]


def test_metadata_refuses_null_block_writes_and_short_tables():
    with pytest.raises(InvalidArgumentError, match="null block"):
        build_attention_metadata([[3, 0]], [2], [3], BLOCK_SIZE)
    # A null block before the new tokens (a freed sliding-window block) is fine.
    build_attention_metadata([[0, 5]], [4], [2], BLOCK_SIZE)
    with pytest.raises(InvalidArgumentError, match="cannot hold 9 tokens"):
        build_attention_metadata([[3, 4]], [8], [1], BLOCK_SIZE)
    with pytest.raises(InvalidArgumentError, match="one block table"):
        build_attention_metadata([[3]], [0, 1], [1], BLOCK_SIZE)


def test_write_then_read_back_and_null_block_invariant():
    store = make_store()
    metadata = build_attention_metadata([[5, 3]], [0], [6], BLOCK_SIZE)
    keys = torch.randn(6, NUM_KV_HEADS, HEAD_DIM)
    values = torch.randn(6, NUM_KV_HEADS, HEAD_DIM)
    store.write("layer0", keys, values, metadata.slot_mapping)
    read_keys, read_values = store.read_tokens("layer0", [5, 3], 6)
    assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
    assert torch.equal(store.kv_caches["layer0"][3, 0, :2], keys[4:])
    assert not store.kv_caches["layer0"][3, 0, 2:].any()  # offsets past the tokens untouched
    store.check_invariants()
    store.kv_caches["layer0"][0, 1, 0, 0, 0] = 1.0
    with pytest.raises(InvariantViolation, match="null block"):
        store.check_invariants()


def dense_attention(q, k, v, q_positions, scale, window):
    """Ground truth on contiguous K/V: [q, h, d] x [k, kvh, d]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    key_pos = torch.arange(k.shape[0])
    allowed = key_pos[None, :] <= q_positions[:, None]
    if window is not None:
        allowed &= key_pos[None, :] > q_positions[:, None] - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("num_heads", [2, 6])
def test_reference_and_sdpa_match_dense_attention(window, num_heads):
    torch.manual_seed(0)
    store = make_store(num_blocks=24)
    # A mixed step: a chunk after a cached prefix, a whole prompt, two decodes.
    tables = [[3, 8, 1, 12], [5, 6, 7], [9, 10], [20]]
    num_computed = [6, 0, 7, 2]
    num_new = [7, 10, 1, 1]
    seq_lens = [c + n for c, n in zip(num_computed, num_new, strict=True)]
    contiguous = []
    for table, seq_len in zip(tables, seq_lens, strict=True):
        keys = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
        values = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM)
        full = build_attention_metadata([table], [0], [seq_len], BLOCK_SIZE)
        store.write("layer0", keys, values, full.slot_mapping)
        contiguous.append((keys, values))
    metadata = build_attention_metadata(tables, num_computed, num_new, BLOCK_SIZE)
    query = torch.randn(sum(num_new), num_heads, HEAD_DIM)
    scale = HEAD_DIM**-0.5
    kv = store.kv_caches["layer0"]
    reference = paged_attention_reference(query, kv, metadata, scale, window)
    fast = paged_attention_sdpa(query, kv, metadata, scale, window)
    start = 0
    for (keys, values), computed, new in zip(contiguous, num_computed, num_new, strict=True):
        q_positions = torch.arange(computed, computed + new)
        expected = dense_attention(
            query[start : start + new], keys, values, q_positions, scale, window
        )
        torch.testing.assert_close(reference[start : start + new], expected)
        start += new
    torch.testing.assert_close(fast, reference, rtol=1e-5, atol=1e-5)


def test_sdpa_decode_batch_matches_reference():
    torch.manual_seed(1)
    store = make_store(num_blocks=12)
    tables = [[1, 2, 3], [4, 5], [6]]
    seq_lens = [11, 5, 1]
    for table, seq_len in zip(tables, seq_lens, strict=True):
        full = build_attention_metadata([table], [0], [seq_len], BLOCK_SIZE)
        store.write("layer0", *torch.randn(2, seq_len, NUM_KV_HEADS, HEAD_DIM), full.slot_mapping)
    metadata = build_attention_metadata(tables, [s - 1 for s in seq_lens], [1, 1, 1], BLOCK_SIZE)
    query = torch.randn(3, 4, HEAD_DIM)
    kv = store.kv_caches["layer0"]
    torch.testing.assert_close(
        paged_attention_sdpa(query, kv, metadata, 0.3, 4),
        paged_attention_reference(query, kv, metadata, 0.3, 4),
        rtol=1e-5,
        atol=1e-5,
    )


def test_unknown_backend_is_rejected():
    assert get_attention_backend("reference").attend is paged_attention_reference
    assert get_attention_backend("sdpa").attend is paged_attention_sdpa
    with pytest.raises(InvalidArgumentError, match="'flash'"):
        get_attention_backend("flash")
