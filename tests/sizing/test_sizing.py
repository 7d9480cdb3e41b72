"""Sizing: page sizes, grouping, page unification (REFERENCE 6.1, 6.2)."""

from __future__ import annotations

import pytest

from pagedkv.errors import ConfigError
from pagedkv.sizing import (
    get_kv_cache_config,
    get_kv_cache_layout,
    promote_local_attention,
    size_kv_cache,
    unify_page_sizes,
)
from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

PAGE = 16384  # block 16 × 2 KV heads × head 64 × fp32 × (K + V), the reference's test spec


def full(head_size: int = 64, block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 2, head_size, 4)


def sliding(head_size: int = 64, window: int = 1024, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 2, head_size, 4, sliding_window=window)


def layer_names_by_group(layout) -> list[list[str]]:
    return [list(group.layer_names) for group in layout.groups]


# --------------------------------------------------------------------------- page sizes


def test_page_sizes_per_spec():
    assert full().page_size_bytes == PAGE
    assert sliding().page_size_bytes == PAGE
    assert (
        ChunkedLocalAttentionSpec(16, 2, 64, 4, attention_chunk_size=8192).page_size_bytes == PAGE
    )
    assert CrossAttentionSpec(16, 2, 64, 4).page_size_bytes == PAGE
    # MLA stores one latent (no separate V): DeepSeek-V3's 512 + 64 in bf16.
    assert MLAAttentionSpec(16, 1, 576, 2).page_size_bytes == 16 * 576 * 2 == 18432
    # Jamba's Mamba state: conv (8192, 3) + SSM (8192, 16) in bf16, independent of block size.
    mamba = MambaSpec(16, ((8192, 3), (8192, 16)), 2)
    assert mamba.page_size_bytes == (8192 * 3 + 8192 * 16) * 2 == 311296
    assert MambaSpec(80, ((8192, 3), (8192, 16)), 2).page_size_bytes == 311296


def test_flat_mamba_shapes_are_one_dimensional_states():
    # vLLM accepts `shapes=(1, 1)` (its tests build Mamba groups so): each int is a shape.
    assert MambaSpec(16, (1, 1), 4).shapes == ((1,), (1,))
    assert MambaSpec(16, (3, (2, 5)), (2, 4)).page_size_bytes == 3 * 2 + 10 * 4
    for bad in ((0, 1), (True,), ((2, True),), 5, ()):
        with pytest.raises(ConfigError, match="shapes must be non-empty positive dims"):
            MambaSpec(16, bad, 2)


def test_per_request_memory_per_spec_and_group():
    # max_model_len 16384, max_in_flight 1024 (REFERENCE 6.5's setting).
    assert full().max_memory_usage_bytes(16384, 1024) == 1024 * PAGE
    assert sliding().max_memory_usage_bytes(16384, 1024) == 129 * PAGE
    layout = get_kv_cache_layout({"l1": full(), "l2": sliding()})
    assert layout.blocks_per_request(16384, 1024) == (1024, 129)
    assert layout.max_memory_usage_bytes(16384, 1024) == 1153 * PAGE


# --------------------------------------------------------------------------- grouping


def test_uniform_spec_is_one_group_with_every_layer():
    layout = get_kv_cache_layout({"l1": full(), "l2": full()})
    assert layer_names_by_group(layout) == [["l1", "l2"]]
    assert layout.groups[0].kv_cache_spec == full()
    assert layout.bytes_per_block == 2 * PAGE


def test_two_full_four_sliding():
    specs = {"l1": full(), "l2": full()} | {f"l{i}": sliding() for i in range(3, 7)}
    layout = get_kv_cache_layout(specs)
    assert layer_names_by_group(layout) == [["l1", "l2"], ["l3", "l5"], ["l4", "l6"]]
    assert [g.kv_cache_spec.kind for g in layout.groups] == [
        "full_attention",
        "sliding_window",
        "sliding_window",
    ]
    assert layout.bytes_per_block == 2 * PAGE


def test_three_full_seven_sliding():
    specs = {f"l{i}": full() for i in range(1, 4)} | {f"l{i}": sliding() for i in range(4, 11)}
    layout = get_kv_cache_layout(specs)
    assert layer_names_by_group(layout) == [
        ["l1", "l2", "l3"],
        ["l4", "l7", "l10"],
        ["l5", "l8"],
        ["l6", "l9"],
    ]
    assert layout.bytes_per_block == 3 * PAGE


def test_six_full_five_sliding_uses_the_larger_group_size():
    # 6 < 1.5 × 5, so groups take 6 layers and the sliding group has one empty slot.
    specs = {f"l{i}": full() for i in range(1, 7)} | {f"l{i}": sliding() for i in range(7, 12)}
    layout = get_kv_cache_layout(specs)
    assert layer_names_by_group(layout) == [
        ["l1", "l2", "l3", "l4", "l5", "l6"],
        ["l7", "l8", "l9", "l10", "l11"],
    ]
    assert layout.bytes_per_block == 6 * PAGE


def test_buckets_follow_first_appearance():
    # Gemma 2 style: the first layer is windowed, so the sliding bucket comes first.
    specs = {f"l{i}": (sliding() if i % 2 == 0 else full()) for i in range(4)}
    layout = get_kv_cache_layout(specs)
    assert layer_names_by_group(layout) == [["l0", "l2"], ["l1", "l3"]]
    assert [g.kv_cache_spec.kind for g in layout.groups] == ["sliding_window", "full_attention"]


def test_smaller_page_gets_a_larger_block_size():
    # full d64 + SW d32: the SW page (8192) divides 16384, so its block size doubles.
    layout = get_kv_cache_layout({"l1": full(64), "l2": sliding(32)})
    assert [g.kv_cache_spec.block_size for g in layout.groups] == [16, 32]
    assert [g.kv_cache_spec.page_size_bytes for g in layout.groups] == [PAGE, PAGE]
    assert layout.groups[1].kv_cache_spec == sliding(32, block_size=32)


def test_non_dividing_page_is_padded():
    # full d64 (16384) + SW d96 (24576): 24576 % 16384 != 0, so the full page is padded.
    layout = get_kv_cache_layout({"l1": full(64), "l2": sliding(96)})
    full_spec, sliding_spec = (g.kv_cache_spec for g in layout.groups)
    assert full_spec.page_size_padded == 24576
    assert full_spec.real_page_size_bytes == PAGE
    assert full_spec.block_size == 16
    assert sliding_spec == sliding(96)
    result = size_kv_cache({"l1": full(64), "l2": sliding(96)}, PAGE * 2 * 32, 16)
    assert result.bytes_per_block == 24576
    assert result.num_blocks == 42


def test_same_type_different_head_sizes_is_one_group_with_summed_pages():
    specs = {"l1": full(64), "l2": full(128), "l3": full(64)}
    layout = get_kv_cache_layout(specs)
    assert layer_names_by_group(layout) == [["l1", "l2", "l3"]]
    assert layout.groups[0].kv_cache_spec == full(64)  # the first layer's spec
    assert layout.layer_to_spec["l2"] == full(128)  # no unification: pages stay real
    assert layout.bytes_per_block == PAGE + 2 * PAGE + PAGE
    config = get_kv_cache_config(layout, 10)
    assert config.kv_cache_tensors == (
        KVCacheTensor(PAGE * 10, ("l1",)),
        KVCacheTensor(2 * PAGE * 10, ("l2",)),
        KVCacheTensor(PAGE * 10, ("l3",)),
    )


def test_same_type_different_windows_is_hybrid():
    layout = get_kv_cache_layout({"l1": sliding(window=128), "l2": sliding(window=4096)})
    assert [g.kv_cache_spec.sliding_window for g in layout.groups] == [128, 4096]


def test_mamba_hybrid_grows_attention_blocks_then_pads_mamba():
    mamba = MambaSpec(16, ((8192, 3), (8192, 16)), 2, mamba_cache_mode="align")  # 311296 bytes
    attention = FullAttentionSpec(16, 8, 128, 2)  # 65536 bytes at 16 tokens
    specs = {"l0": mamba, "l1": mamba, "l2": attention, "l3": mamba, "l4": attention}
    layout = get_kv_cache_layout(specs)
    # 16 × cdiv(311296, 65536) = 80 tokens → 327680 bytes; Mamba padded up to it.
    # Buckets of 3 and 2 layers (3 is not below 1.5 × 2): groups of 2.
    assert layer_names_by_group(layout) == [["l0", "l3"], ["l1"], ["l2", "l4"]]
    mamba_spec, _, attention_spec = (g.kv_cache_spec for g in layout.groups)
    assert attention_spec == FullAttentionSpec(80, 8, 128, 2)
    assert attention_spec.page_size_bytes == 327680
    assert mamba_spec.block_size == 80
    assert mamba_spec.page_size_padded == 327680
    assert mamba_spec.real_page_size_bytes == 311296


def test_mla_page_that_cannot_be_scaled_or_padded_is_an_error():
    specs = {
        "l1": MLAAttentionSpec(16, 1, 576, 2),
        "l2": SlidingWindowSpec(16, 1, 500, 2, sliding_window=8),
    }
    # SW page 32000 is the largest; the MLA page 18432 does not divide it.
    with pytest.raises(ConfigError, match=r"layer 'l1' \(mla_attention\) has a page of 18432"):
        unify_page_sizes(specs)


def test_unify_leaves_equal_pages_alone():
    specs = {"l1": full(), "l2": sliding()}
    assert unify_page_sizes(specs) == specs


def test_cross_attention_with_decoder_self_attention():
    specs = {}
    for i in range(3):
        specs[f"decoder.{i}.self"] = full()
        specs[f"decoder.{i}.cross"] = CrossAttentionSpec(16, 2, 64, 4)
    layout = get_kv_cache_layout(specs)
    assert [g.kv_cache_spec.kind for g in layout.groups] == ["full_attention", "cross_attention"]
    assert layout.blocks_per_request(100, None, max_num_encoder_input_tokens=1500) == (7, 94)


def test_empty_model_has_no_groups_and_only_the_null_block():
    layout = get_kv_cache_layout({})
    assert layout.groups == ()
    config = get_kv_cache_config(layout, 1)
    assert config.num_blocks == 1
    assert config.kv_cache_tensors == ()


def test_non_spec_layer_is_rejected():
    with pytest.raises(ConfigError, match="layer 'l1': expected a KVCacheSpec"):
        get_kv_cache_layout({"l1": 16})


# --------------------------------------------------------------------------- hybrid manager off


def test_disable_hybrid_promotes_windows_to_full_attention():
    specs = {
        "l0": sliding(window=4096),
        "l1": full(),
        "l2": ChunkedLocalAttentionSpec(16, 2, 64, 4, attention_chunk_size=8192),
    }
    promoted = promote_local_attention(specs)
    assert promoted["l0"] == FullAttentionSpec(16, 2, 64, 4, sliding_window=4096)
    assert promoted["l1"] == full()
    assert promoted["l2"] == FullAttentionSpec(16, 2, 64, 4, attention_chunk_size=8192)
    layout = get_kv_cache_layout(specs, disable_hybrid=True)
    assert layer_names_by_group(layout) == [["l0", "l1", "l2"]]
    # The group is managed as plain full attention; each layer keeps its window for compute.
    assert layout.groups[0].kv_cache_spec == full()
    assert layout.layer_to_spec["l0"].sliding_window == 4096
    assert layout.blocks_per_request(16384, 1024) == (1024,)


def test_disable_hybrid_keeps_a_uniform_sliding_model():
    specs = {"l0": sliding(), "l1": sliding()}
    layout = get_kv_cache_layout(specs, disable_hybrid=True)
    assert layout.groups[0].kv_cache_spec == sliding()


def test_disable_hybrid_with_mamba_is_an_error():
    specs = {"l0": full(), "l1": MambaSpec(16, ((64, 3),), 2)}
    with pytest.raises(ConfigError, match=r"cannot disable the hybrid KV-cache manager.*mamba"):
        get_kv_cache_layout(specs, disable_hybrid=True)
