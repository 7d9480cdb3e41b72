"""What speculative decoding asks of the prefix cache, as vLLM 0.33 does it: EAGLE's last-block
drop, the re-prefillable tail of multi-module MTP, hash lookahead (a block is hashed, so cached,
only once the tokens after it exist), plus `max_cache_hit_length` and the context-parallel
refusal. Every expected value was produced by the same calls on vLLM 0.33's own manager."""

from __future__ import annotations

import pytest

from pagedkv import (
    BlockStored,
    ConfigError,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)
from tests.support.hybrid import full, make_manager, swa


def request(request_id: str, num_tokens: int, lookahead: int = 0, hash_block_size: int = 4):
    hasher = make_request_block_hasher(hash_block_size, num_hash_lookahead_tokens=lookahead)
    return Request(request_id, list(range(num_tokens)), block_hasher=hasher)


def hit(manager, req, max_cache_hit_length=None):
    blocks, num_tokens, _ = manager.get_computed_blocks(req, max_cache_hit_length)
    return blocks.get_block_ids(), num_tokens


def test_eagle_drops_the_last_matched_block() -> None:
    manager = make_manager(20, full(4), use_eagle=True)
    assert manager.allocate_slots(request("a", 18), 18).get_block_ids() == ([1, 2, 3, 4, 5],)
    # Four blocks match; EAGLE recomputes the last one.
    assert hit(manager, request("b", 18)) == (([1, 2, 3],), 12)
    assert hit(manager, request("c", 30)) == (([1, 2, 3],), 12)
    assert hit(manager, request("d", 30), max_cache_hit_length=9) == (([1],), 4)
    manager.check_invariants()


def test_eagle_sliding_window_needs_one_block_more_and_drops_it() -> None:
    manager = make_manager(20, swa(4, 8), use_eagle=True)
    assert manager.allocate_slots(request("a", 26), 26).get_block_ids() == (list(range(1, 8)),)
    assert hit(manager, request("b", 26)) == (([0, 0, 0, 4, 5],), 20)
    assert hit(manager, request("c", 40)) == (([0, 0, 0, 4, 5],), 20)


def test_eagle_in_the_hybrid_fixed_point() -> None:
    manager = make_manager(40, full(8), swa(4, 8), use_eagle=True, hash_block_size=4)
    new_blocks = manager.allocate_slots(request("a", 37), 37)
    assert new_blocks.get_block_ids() == ([1, 2, 3, 4, 5], list(range(6, 16)))
    expected = (([1, 2, 3], [0, 0, 0, 0, 10, 11]), 24)
    assert hit(manager, request("b", 37)) == expected
    assert hit(manager, request("c", 60)) == expected


def test_the_reprefillable_tail_is_not_cached_yet() -> None:
    # Multi-module MTP reading 3 tokens ahead may prefill the last 2 again.
    manager = make_manager(20, full(4), num_prefill_lookahead=3)
    assert manager.allocate_slots(request("a", 18), 18).get_block_ids() == ([1, 2, 3, 4, 5],)
    assert manager.block_pool.num_cached_blocks() == 4  # 16 of 18 - 2 tokens
    assert hit(manager, request("b", 30)) == (([1, 2, 3, 4],), 16)
    with pytest.raises(ConfigError, match=r"scheduler_block_size \(4\) >= num_prefill_lookahead"):
        make_manager(20, full(4), use_eagle=True, num_prefill_lookahead=5)


def test_hash_lookahead_caches_only_hashed_blocks_and_reports_the_tokens() -> None:
    manager = make_manager(20, full(4), enable_kv_cache_events=True, num_hash_lookahead_tokens=2)
    req = request("a", 18, lookahead=2)
    assert len(req.block_hashes) == 4  # block 4 waits for tokens 20 and 21
    assert manager.allocate_slots(req, 18).get_block_ids() == ([1, 2, 3, 4, 5],)
    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored)
    assert stored.block_hashes == req.block_hashes
    assert stored.lookahead_token_ids == [[4, 5], [8, 9], [12, 13], [16, 17]]
    req.num_computed_tokens = 18
    num_hashes = []
    for token in range(100, 106):
        req.append_output_token_ids(token)
        manager.allocate_slots(req, 1)
        req.num_computed_tokens += 1
        num_hashes.append(len(req.block_hashes))
        events = manager.take_events()
        if req.num_tokens == 22:
            assert [e.lookahead_token_ids for e in events] == [[[102, 103]]]
        else:
            assert events == []
    assert num_hashes == [4, 4, 4, 5, 5, 5]
    manager.check_invariants()


def test_a_request_without_hashes_caches_nothing() -> None:
    manager = make_manager(20, full(4), enable_kv_cache_events=True)
    req = Request("a", list(range(18)), block_hasher=make_request_block_hasher(4))
    req.block_hashes.clear()  # a hasher running behind (hash lookahead) has none yet
    assert manager.allocate_slots(req, 18).get_block_ids() == ([1, 2, 3, 4, 5],)
    assert manager.block_pool.num_cached_blocks() == 0 and manager.take_events() == []


def test_max_cache_hit_length_is_checked() -> None:
    manager = make_manager(20, full(4))
    with pytest.raises(InvalidArgumentError, match="max_cache_hit_length must be >= 0"):
        manager.get_computed_blocks(request("a", 8), -1)


def test_decode_context_parallelism_scales_sharded_blocks() -> None:
    # vLLM 0.33's accounting: a block of a sharded group covers block_size * dcp tokens (each
    # of the 4 ranks holds 16 of them); the hash and scheduler blocks are given in those units.
    config = KVCacheConfig(8, [KVCacheGroupSpec(("l",), full(16))])
    manager = KVCacheManager(
        config, 256, scheduler_block_size=64, hash_block_size=64, dcp_world_size=4,
        enable_kv_cache_events=True,
    )  # fmt: skip
    assert manager.coordinator.single_type_managers[0].block_size == 64
    assert manager.kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size == 64
    hasher = make_request_block_hasher(64)
    first = Request("a", list(range(130)), block_hasher=hasher)
    assert manager.allocate_slots(first, 130).get_block_ids() == ([1, 2, 3],)
    (event,) = manager.take_events()
    assert (event.block_size, len(event.block_hashes)) == (64, 2)
    manager.free(first)
    hits, num_hit, _ = manager.get_computed_blocks(
        Request("b", list(range(130)), block_hasher=hasher)
    )
    assert (hits.get_block_ids(), num_hit) == (([1, 2],), 128)


def test_context_parallelism_refuses_what_it_cannot_shard() -> None:
    hybrid = KVCacheConfig(
        20, [KVCacheGroupSpec(("f",), full(4)), KVCacheGroupSpec(("w",), swa(4, 8))]
    )
    with pytest.raises(ConfigError, match="group 1 is SlidingWindowSpec: decode context"):
        KVCacheManager(hybrid, 64, dcp_world_size=2)
    with pytest.raises(ConfigError, match="group 1 is SlidingWindowSpec: prefill context"):
        KVCacheManager(hybrid, 64, pcp_world_size=2)
    with pytest.raises(InvalidArgumentError, match="dcp_world_size must be >= 1"):
        KVCacheManager(hybrid, 64, dcp_world_size=0)
    # Prefill context parallelism changes no block size.
    single = KVCacheConfig(8, [KVCacheGroupSpec(("l",), full(4))])
    assert (
        KVCacheManager(single, 16, pcp_world_size=2).coordinator.single_type_managers[0].block_size
        == 4
    )
