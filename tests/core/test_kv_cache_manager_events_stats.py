"""KVCacheManager events (exact contents, lifecycle, annotation) and prefix-cache stats."""

from __future__ import annotations

import logging

import pytest

from pagedkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CachingMetrics,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    LoRARequest,
    MLAAttentionSpec,
    MultiModalFeature,
    PrefixCacheStats,
    RequestStatus,
)
from pagedkv.block import to_external_hash
from tests.support.builders import admit, full_config, make_manager, make_request


def stored(req, start_block, end_block, parent, block_size=16, **overrides) -> BlockStored:
    fields = dict(
        block_hashes=list(req.block_hashes[start_block:end_block]),
        parent_block_hash=parent,
        token_ids=req.all_token_ids[start_block * block_size : end_block * block_size],
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        # One entry per block (vLLM 0.33), None for a block without keys.
        extra_keys=[None] * (end_block - start_block) or None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        kv_cache_spec_sliding_window=None,
        session_id=None,
    )
    fields.update(overrides)
    return BlockStored(**fields)


# ---------------------------------------------------------------------------- events


def test_event_lifecycle():
    """The reference's test_kv_cache_events: stored, removed on reuse, cleared on reset."""
    manager = make_manager(4, 16, enable_kv_cache_events=True)
    r0 = make_request("0", list(range(48)))
    assert admit(manager, r0) == ([1, 2, 3], 0)
    assert manager.take_events() == [stored(r0, 0, 3, None)]
    assert manager.take_events() == []
    manager.free(r0)
    assert manager.take_events() == []  # freeing evicts nothing (lazy eviction)
    r1 = make_request("1", list(range(48, 96)))
    assert admit(manager, r1) == ([3, 2, 1], 0)
    removed = [
        BlockRemoved(block_hashes=[r0.block_hashes[i]], medium="GPU", group_idx=0)
        for i in (2, 1, 0)
    ]
    assert manager.take_events() == [*removed, stored(r1, 0, 3, None)]
    manager.free(r1)
    assert manager.reset_prefix_cache() is True
    assert manager.take_events() == [AllBlocksCleared()]
    assert manager.block_pool.num_cached_blocks() == 0


def test_events_across_chunks_and_decode_carry_parent():
    manager = make_manager(11, 16, enable_kv_cache_events=True)
    req = make_request("r", list(range(40)), session_id="sess")
    manager.allocate_slots(req, 20)
    req.num_computed_tokens = 20
    manager.allocate_slots(req, 20)
    req.num_computed_tokens = 40
    for token in range(8):
        req.append_output_token_ids(500 + token)
    manager.allocate_slots(req, 8)
    assert manager.take_events() == [
        stored(req, 0, 1, None, session_id="sess"),
        stored(req, 1, 2, req.block_hashes[0], session_id="sess"),
        stored(req, 2, 3, req.block_hashes[1], session_id="sess"),
    ]
    assert manager.take_events() == []


def test_events_of_a_hit_request_cover_only_new_blocks():
    manager = make_manager(11, 16, enable_kv_cache_events=True)
    r0 = make_request("0", list(range(40)))
    admit(manager, r0)
    manager.take_events()
    r1 = make_request("1", list(range(33)) + [7] * 20)
    assert admit(manager, r1) == ([4, 5], 32)  # 53 tokens: 4 blocks, the last partial
    assert manager.take_events() == [stored(r1, 2, 3, r1.block_hashes[1])]


def test_event_lora_and_extra_keys():
    manager = make_manager(11, 16, enable_kv_cache_events=True)
    lora = LoRARequest("adapter", "/path/adapter", adapter_id=7)
    req = make_request(
        "r",
        list(range(40)),
        lora_request=lora,
        cache_salt="salt",
        mm_features=[MultiModalFeature("img", 10, 12)],
    )
    admit(manager, req)
    assert manager.take_events() == [
        stored(
            req,
            0,
            2,
            None,
            lora_id=7,
            lora_name="adapter",
            extra_keys=[("adapter", ("img", 10), "salt"), ("adapter", ("img", -6))],
        )
    ]


def test_event_extra_keys_none_entry_per_keyless_block():
    manager = make_manager(11, 16, enable_kv_cache_events=True)
    req = make_request("r", list(range(50)), mm_features=[MultiModalFeature("img", 20, 4)])
    admit(manager, req)
    (event,) = manager.take_events()
    assert event.extra_keys == [None, (("img", 4),), None]
    assert event.block_hashes == req.block_hashes


def test_take_events_annotates_spec_kind():
    spec = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=576, dtype_bytes=2)
    config = KVCacheConfig(5, (KVCacheGroupSpec(("mla",), spec),))
    manager = KVCacheManager(config, 1024, enable_kv_cache_events=True)
    req = make_request("r", list(range(17)))
    admit(manager, req)
    (event,) = manager.take_events()
    assert event.kv_cache_spec_kind == "mla_attention"
    assert event.kv_cache_spec_sliding_window is None
    assert event.group_idx == 0


def test_take_events_out_of_range_group_warns(caplog):
    manager = make_manager(5, 16, enable_kv_cache_events=True)
    bad = BlockStored([b"h"], None, [1], 16, None, "GPU", group_idx=3)
    manager.block_pool.kv_event_queue.append(bad)
    with caplog.at_level(logging.WARNING, logger="pagedkv.kv_cache_manager"):
        assert manager.take_events() == [bad]
    assert bad.kv_cache_spec_kind is None
    assert "KV event group 3 is not in KV cache metadata" in caplog.text


def test_events_disabled():
    manager = make_manager(4, 16)
    r0 = make_request("0", list(range(48)))
    admit(manager, r0)
    manager.free(r0)
    admit(manager, make_request("1", list(range(100, 148))))
    assert manager.take_events() == []
    assert manager.block_pool.kv_event_queue == []


def test_external_hash_is_low_64_bits():
    digest = bytes(range(32))
    assert to_external_hash(digest) == int.from_bytes(digest[-8:], "big")
    assert to_external_hash(digest, use_int=False) == digest


# ---------------------------------------------------------------------------- stats


def test_stats_disabled():
    """The reference's test_prefix_cache_stats_disabled."""
    manager = make_manager(11, 16, log_stats=False)
    assert manager.prefix_cache_stats is None
    req = make_request("0", list(range(40)))
    _, num_hit_tokens = admit(manager, req)
    manager.record_prefix_cache_stats(req, num_hit_tokens)
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.prefix_cache_stats is None
    assert manager.make_prefix_cache_stats() is None


def test_stats_counting_and_get_and_reset():
    manager = make_manager(11, 16, log_stats=True)
    r0 = make_request("0", list(range(40)))
    _, hits0 = admit(manager, r0)
    manager.record_prefix_cache_stats(r0, hits0)
    r1 = make_request("1", list(range(40)) + [1])
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    # Lookups alone record nothing.
    assert manager.prefix_cache_stats == PrefixCacheStats(requests=1, queries=40, hits=0)
    manager.allocate_slots(r1, 41 - num_hit_tokens, num_hit_tokens, hits)
    manager.record_prefix_cache_stats(r1, num_hit_tokens)
    skipping = make_request("2", list(range(40)), skip_reading_prefix_cache=True)
    manager.record_prefix_cache_stats(skipping, 0)  # lookup disabled: not counted
    stats = manager.make_prefix_cache_stats()
    assert stats == PrefixCacheStats(requests=2, queries=81, hits=32)
    assert manager.make_prefix_cache_stats() == PrefixCacheStats()
    assert manager.prefix_cache_stats is not stats


def test_stats_preempted_trio_and_reset_flag():
    manager = make_manager(11, 16, log_stats=True)
    req = make_request("0", list(range(40)))
    admit(manager, req)
    req.append_output_token_ids(list(range(10)))
    manager.allocate_slots(req, 10)  # decode: block 2 (tokens 32..47) becomes full, cached
    manager.free(req)
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.num_preemptions = 1
    _, num_hit_tokens = admit(manager, req)
    assert num_hit_tokens == 48
    manager.record_prefix_cache_stats(req, num_hit_tokens)
    manager.free(req)
    assert manager.reset_prefix_cache() is True
    assert manager.make_prefix_cache_stats() == PrefixCacheStats(
        reset=True, preempted_requests=1, preempted_queries=50, preempted_hits=48
    )
    # A refused reset does not set the flag.
    admit(manager, make_request("1", [1] * 20))
    assert manager.reset_prefix_cache() is False
    assert manager.make_prefix_cache_stats().reset is False


def test_prefix_cache_stats_record():
    stats = PrefixCacheStats()
    stats.record(100, 32, preempted=False)
    stats.record(50, 48, preempted=True)
    stats.record(10, 0, preempted=False)
    assert stats == PrefixCacheStats(
        reset=False,
        requests=2,
        queries=110,
        hits=32,
        preempted_requests=1,
        preempted_queries=50,
        preempted_hits=48,
    )


def test_caching_metrics_sliding_window():
    metrics = CachingMetrics(max_recent_requests=5)
    assert metrics.empty and metrics.hit_rate == 0.0
    metrics.observe(PrefixCacheStats(requests=1, queries=20, hits=9))
    assert not metrics.empty and metrics.hit_rate == pytest.approx(0.45)
    metrics.observe(PrefixCacheStats(requests=2, queries=20, hits=20))
    assert metrics.hit_rate == pytest.approx(29 / 40)
    # 6 requests > 5: the oldest snapshot (1, 20, 9) is dropped whole.
    metrics.observe(PrefixCacheStats(requests=3, queries=40, hits=0))
    assert (metrics.aggregated_requests, metrics.aggregated_queries) == (5, 60)
    assert metrics.hit_rate == pytest.approx(20 / 60)
    # Snapshots without requests are ignored, even with queries.
    metrics.observe(PrefixCacheStats(requests=0, queries=100, hits=100))
    assert metrics.hit_rate == pytest.approx(20 / 60)
    # One snapshot larger than the window: older ones go, the last one stays.
    metrics.observe(PrefixCacheStats(requests=10, queries=10, hits=10))
    assert metrics.aggregated_requests == 10 and metrics.hit_rate == 1.0
    metrics.observe(PrefixCacheStats(reset=True))
    assert metrics.empty and metrics.hit_rate == 0.0
    metrics.observe(PrefixCacheStats(reset=True, requests=1, queries=4, hits=1))
    assert metrics.hit_rate == 0.25 and metrics.aggregated_requests == 1


def test_full_config_helper_is_one_full_attention_group():
    config = full_config(7, 32)
    assert config.num_blocks == 7
    assert config.kv_cache_groups[0].kv_cache_spec.block_size == 32
