"""Sizing: bytes → num_blocks, null-block reservation, errors, concurrency (REFERENCE 6.3-6.5)."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidArgumentError, NotEnoughMemoryError
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from pagedkv.sizing import (
    check_enough_memory,
    estimate_max_model_len,
    format_gib,
    get_kv_cache_layout,
    get_max_concurrency,
    get_num_blocks,
    size_kv_cache,
)
from pagedkv.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

PAGE = 16384


def full() -> FullAttentionSpec:
    return FullAttentionSpec(16, 2, 64, 4)


def sliding(window: int = 1024) -> SlidingWindowSpec:
    return SlidingWindowSpec(16, 2, 64, 4, sliding_window=window)


# --------------------------------------------------------------------------- num_blocks, tensors


def test_two_identical_layers():
    result = size_kv_cache({"l1": full(), "l2": full()}, PAGE * 2 * 32, 16)
    assert result.num_blocks == 32
    assert result.bytes_per_block == 2 * PAGE
    # One tensor per layer position of a group, each holding num_blocks pages.
    assert result.kv_cache_config.kv_cache_tensors == (
        KVCacheTensor(PAGE * 32, ("l1",)),
        KVCacheTensor(PAGE * 32, ("l2",)),
    )
    total = sum(t.size_bytes for t in result.kv_cache_config.kv_cache_tensors)
    assert total == PAGE * 2 * 32


def test_one_full_one_sliding_doubles_the_blocks():
    result = size_kv_cache({"l1": full(), "l2": sliding()}, PAGE * 2 * 32, 16)
    assert [list(g.layer_names) for g in result.kv_cache_config.kv_cache_groups] == [["l1"], ["l2"]]
    assert result.num_blocks == 64
    # Groups alias the same bytes: one tensor shared by both groups' first layer.
    assert result.kv_cache_config.kv_cache_tensors == (KVCacheTensor(PAGE * 64, ("l1", "l2")),)


def test_hybrid_tensors_are_shared_position_by_position():
    specs = {"l1": full(), "l2": full()} | {f"l{i}": sliding() for i in range(3, 7)}
    result = size_kv_cache(specs, 2 * PAGE * 100, 64)
    assert result.num_blocks == 100
    assert result.kv_cache_config.kv_cache_tensors == (
        KVCacheTensor(PAGE * 100, ("l1", "l3", "l4")),
        KVCacheTensor(PAGE * 100, ("l2", "l5", "l6")),
    )


def test_num_blocks_rounds_down():
    layout = get_kv_cache_layout({"l1": full()})
    assert get_num_blocks(layout, PAGE * 33 - 1) == 32
    assert get_num_blocks(layout, PAGE * 33) == 33
    assert get_num_blocks(get_kv_cache_layout({}), 0) == 1


# --------------------------------------------------------------------------- null-block edge


def test_exactly_enough_minus_the_null_block_is_rejected():
    # 512 tokens / 16 = 32 blocks: memory for 32 blocks is rejected, for 33 accepted.
    layout = get_kv_cache_layout({"l1": full()})
    with pytest.raises(NotEnoughMemoryError):
        check_enough_memory(layout, PAGE * 32, 512)
    check_enough_memory(layout, PAGE * 33, 512)
    result = size_kv_cache({"l1": full()}, PAGE * 33, 512)
    assert result.num_blocks == 33


def test_the_accepted_edge_really_holds_one_full_request():
    result = size_kv_cache({"l1": full()}, PAGE * 33, 512)
    manager = KVCacheManager(result.kv_cache_config, max_model_len=512, enable_caching=False)
    first = Request("a", list(range(512)))
    blocks = manager.allocate_slots(first, 512)
    assert blocks is not None
    assert len(blocks.get_block_ids()[0]) == 32
    assert manager.block_pool.get_num_free_blocks() == 0
    assert manager.allocate_slots(Request("b", [1]), 1) is None


def test_error_text_states_needed_available_and_longest_fit():
    layout = get_kv_cache_layout({"l1": full()})
    with pytest.raises(NotEnoughMemoryError) as caught:
        check_enough_memory(layout, PAGE * 32, 512)
    error = caught.value
    assert str(error) == (
        "not enough KV-cache memory: one request of max_model_len=512 needs 540672 bytes "
        "(0.0 GiB, null block included), but only 524288 bytes (0.0 GiB) are available; "
        "the longest max_model_len that fits is 496"
    )
    assert (error.needed_bytes, error.available_bytes) == (540672, 524288)
    assert (error.max_model_len, error.max_model_len_that_fits) == (512, 496)
    assert isinstance(error, ValueError)


def test_error_when_not_even_one_token_fits():
    layout = get_kv_cache_layout({"l1": full()})
    with pytest.raises(NotEnoughMemoryError, match="not even a 1-token request fits") as caught:
        check_enough_memory(layout, PAGE + 1, 512)
    assert caught.value.max_model_len_that_fits == 0


def test_error_when_no_memory():
    layout = get_kv_cache_layout({"l1": full()})
    with pytest.raises(NotEnoughMemoryError, match=r"available_memory_bytes=0\)"):
        check_enough_memory(layout, 0, 512)


def test_bad_arguments_name_the_value():
    layout = get_kv_cache_layout({"l1": full()})
    with pytest.raises(InvalidArgumentError, match="max_model_len must be positive, got 0"):
        check_enough_memory(layout, PAGE * 10, 0)
    with pytest.raises(InvalidArgumentError, match="available_memory_bytes must be an int"):
        check_enough_memory(layout, 1.5e9, 16)


def test_format_gib():
    assert format_gib(80 << 30) == 80.0
    assert format_gib(3 << 29) == 1.5


# --------------------------------------------------------------------------- estimate


def test_estimate_max_model_len_is_the_longest_fit():
    layout = get_kv_cache_layout({"l1": full()})
    # 100 blocks: 99 usable → 1584 tokens.
    assert estimate_max_model_len(layout, PAGE * 100, 1_000_000) == 1584
    assert estimate_max_model_len(layout, PAGE * 100, 1000) == 1000
    assert estimate_max_model_len(layout, PAGE, 1000) == 0


def test_estimate_for_sliding_window_saturates_at_the_limit():
    # A windowed request never needs more than its window, so any length fits.
    layout = get_kv_cache_layout({"l1": sliding(window=64)})
    assert estimate_max_model_len(layout, PAGE * 20, 10**9, max_in_flight_tokens=128) == 10**9


def test_estimate_for_hybrid():
    layout = get_kv_cache_layout({"l1": full(), "l2": sliding(window=64)})
    # 200 blocks, 199 usable; SW needs cdiv(63 + 16, 16) + 1 = 6 → full gets 193 → 3088 tokens.
    assert estimate_max_model_len(layout, PAGE * 200, 10**6, max_in_flight_tokens=16) == 3088


# --------------------------------------------------------------------------- concurrency


def _config(num_blocks: int, *specs) -> KVCacheConfig:
    groups = [KVCacheGroupSpec((f"l{i}",), spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks, groups)


@pytest.mark.parametrize(
    ("num_blocks", "specs", "expected"),
    [
        (1536, (full(),), 1.5),  # full attention needs 1024 blocks
        (387, (sliding(),), 3.0),  # SW(1024) needs cdiv(1023 + 1024, 16) + 1 = 129
        (3459, (full(), sliding()), 3.0),  # hybrid needs 1153
        (3459 + 1153, (full(), sliding(), full(), sliding()), 2.0),  # 2306 per request
    ],
)
def test_max_concurrency(num_blocks, specs, expected):
    config = _config(num_blocks, *specs)
    assert get_max_concurrency(config, 16384, max_in_flight_tokens=1024) == expected


def test_max_concurrency_of_a_mixed_head_size_group():
    specs = {"l1": full(), "l2": FullAttentionSpec(16, 2, 128, 4)}
    result = size_kv_cache(specs, 3 * PAGE * 1536, 16384, max_in_flight_tokens=1024)
    assert result.num_blocks == 1536
    assert result.max_concurrency == 1.5
    assert result.token_capacity == 24576


def test_size_kv_cache_reports_capacity():
    result = size_kv_cache(
        {"l1": full(), "l2": sliding()}, PAGE * 3459, 16384, max_in_flight_tokens=1024
    )
    assert result.num_blocks == 3459
    assert result.blocks_per_request == (1024, 129)
    assert result.max_memory_usage_bytes == 1153 * PAGE
    assert result.max_concurrency == 3.0
    assert result.token_capacity == 3 * 16384


def test_attention_free_model():
    result = size_kv_cache({}, 1 << 20, 512)
    assert result.num_blocks == 1
    assert result.kv_cache_config.kv_cache_groups == ()
    assert result.max_concurrency == float("inf")
