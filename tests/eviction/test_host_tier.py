"""The host-memory tier: device victims demoted to it, host hits loaded back, CPU events."""

from __future__ import annotations

import pytest

from pagedkv import (
    BlockRemoved,
    BlockStored,
    ConfigError,
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    RequestStateError,
    SlidingWindowSpec,
)
from tests.support.builders import make_request
from tests.support.eviction import eviction_config, policy_manager

BS = 4


def host_manager(num_blocks: int = 6, host_num_blocks: int = 4, policy: str = "lru"):
    return policy_manager(
        policy,
        num_blocks,
        BS,
        eviction=eviction_config(policy, host_num_blocks=host_num_blocks),
        enable_kv_cache_events=True,
    )


def serve(manager, request):
    """Device hits, then host hits as external tokens, then the rest; free. Returns
    (device hit tokens, host hit tokens)."""
    hits, num_device, _ = manager.get_computed_blocks(request)
    num_host = manager.get_num_host_hit_tokens(request, num_device)
    new_blocks = manager.allocate_slots(
        request,
        request.num_tokens - num_device - num_host,
        num_device,
        hits,
        num_external_computed_tokens=num_host,
    )
    assert new_blocks is not None
    manager.load_from_host(request, num_device, num_host)
    manager.check_invariants()
    manager.free(request)
    manager.check_invariants()
    return num_device, num_host


def test_device_victims_are_demoted_and_host_hits_are_loaded_back():
    manager = host_manager()  # 5 usable device blocks, 4 host blocks
    a = make_request("a", list(range(17)), BS)  # 4 full blocks + 1
    assert serve(manager, a) == (0, 0)
    manager.take_events()
    b = make_request("b", list(range(100, 117)), BS)  # evicts a's 4 cached blocks
    assert serve(manager, b) == (0, 0)
    events = manager.take_events()
    gpu_removed = [e.block_hashes[0] for e in events if type(e) is BlockRemoved]
    cpu_stored = [e for e in events if type(e) is BlockStored and e.medium == "CPU"]
    assert sorted(gpu_removed) == sorted(a.block_hashes)
    assert [e.block_hashes[0] for e in cpu_stored] == gpu_removed
    assert all(e.token_ids == [] and e.block_size == 0 and e.group_idx == 0 for e in cpu_stored)
    host = manager.block_pool.host_tier
    assert set(host.cached_hashes()) == set(a.block_hashes)
    # a again: no device hit, the whole prefix (4 blocks, capped at 16 of 17 tokens) from host.
    again = make_request("a2", list(range(17)), BS)
    assert serve(manager, again) == (0, 16)
    stats = manager.get_eviction_stats()
    assert (stats.num_host_loads, stats.num_host_blocks) == (4, 4)
    # b's blocks were demoted in turn, pushing a's out of the 4-block host tier... and back.
    assert stats.num_host_demotions == 8 and stats.num_host_evictions == 4


def test_host_tier_evicts_least_recently_used_first_with_cpu_events():
    manager = host_manager(num_blocks=3, host_num_blocks=2)  # 2 device blocks
    hashes = []
    for index in range(4):
        request = make_request(f"r{index}", [index] * 8, BS)  # 2 full blocks each
        serve(manager, request)
        hashes.append(request.block_hashes)
    host = manager.block_pool.host_tier
    # r0 and r1 were demoted (4 blocks) into 2 slots: r1's survive, then r2's replace them.
    assert host.cached_hashes() == list(reversed(hashes[2]))
    cpu_removed = [
        e.block_hashes[0]
        for e in manager.take_events()
        if type(e) is BlockRemoved and e.medium == "CPU"
    ]
    assert cpu_removed == [hashes[0][1], hashes[0][0], hashes[1][1], hashes[1][0]]


def test_device_hits_come_first_then_host_hits_continue_the_prefix():
    manager = host_manager(num_blocks=5, host_num_blocks=8)  # 4 device blocks
    long = make_request("long", list(range(12)) + [99], BS)  # 1 2 3 cached, 4 partial
    serve(manager, long)
    # A different 8-token prompt takes block 4 and evicts long's tail block 3.
    serve(manager, make_request("other", list(range(200, 208)), BS))
    again = make_request("again", list(range(12)) + [99], BS)
    assert serve(manager, again) == (8, 4)


def test_host_lookup_checks_its_arguments():
    manager = host_manager()
    request = make_request("r", list(range(9)), BS)
    with pytest.raises(InvalidArgumentError, match="num_computed_tokens=3"):
        manager.get_num_host_hit_tokens(request, 3)
    with pytest.raises(RequestStateError, match="load_from_host"):
        manager.load_from_host(request, 0, 4)
    assert policy_manager("lru", 6, BS).get_num_host_hit_tokens(request, 0) == 0


def test_host_tier_needs_one_full_attention_group():
    window = SlidingWindowSpec(BS, 1, 1, 1, sliding_window=8)
    with pytest.raises(ConfigError, match="one full-attention"):
        KVCacheManager(
            KVCacheConfig(8, (KVCacheGroupSpec(("w",), window),)),
            64,
            eviction=eviction_config("lru", host_num_blocks=4),
        )
    full = FullAttentionSpec(BS, 1, 1, 1)
    groups = (KVCacheGroupSpec(("f",), full), KVCacheGroupSpec(("w",), window))
    with pytest.raises(ConfigError, match="one KV-cache group"):
        KVCacheManager(
            KVCacheConfig(8, groups), 64, eviction=eviction_config("lru", host_num_blocks=4)
        )


def test_reset_clears_the_host_tier_too():
    manager = host_manager(num_blocks=3, host_num_blocks=4)
    for index in range(3):
        serve(manager, make_request(f"r{index}", [index] * 8, BS))
    assert len(manager.block_pool.host_tier) == 4
    assert manager.reset_prefix_cache()
    assert len(manager.block_pool.host_tier) == 0
    manager.check_invariants()
