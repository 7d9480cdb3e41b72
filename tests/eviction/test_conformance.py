"""One conformance suite for every eviction policy (the cachetools pattern): the same scenarios,
the same invariants, the same events. Policy-specific orders are pinned in
tests/eviction/test_policies.py; random interleavings in tests/eviction/test_property.py."""

from __future__ import annotations

import random

import pytest

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, ConfigError, InvalidArgumentError
from pagedkv.eviction import EvictionConfig, EvictionPolicy, FreeKVCacheBlockQueue
from tests.support.builders import admit, make_request
from tests.support.eviction import (
    ALL_POLICIES,
    EventMirror,
    eviction_config,
    policy_manager,
    pool_hash_counts,
)

BS = 4
ALL_CONFIGS = [pytest.param((name, False), id=name) for name in ALL_POLICIES] + [
    pytest.param((name, True), id=f"{name}+retention") for name in ALL_POLICIES
]


def manager_for(param, num_blocks: int, block_size: int = BS, **kwargs):
    policy, retention = param
    kwargs.setdefault("enable_kv_cache_events", True)
    return policy_manager(
        policy,
        num_blocks,
        block_size,
        eviction=eviction_config(policy, retention=retention),
        **kwargs,
    )


def run(manager, request_id: str, tokens: list[int]):
    """Admit a whole prompt, then free it; return (new block ids, hit tokens)."""
    request = make_request(request_id, tokens, manager.hash_block_size)
    new_ids, num_hit = admit(manager, request)
    assert new_ids is not None
    manager.check_invariants()
    manager.free(request)
    manager.check_invariants()
    return new_ids, num_hit


# ---------------------------------------------------------------------------- construction


def test_default_is_the_reference_free_queue():
    manager = policy_manager("lru", 8, BS, eviction=EvictionConfig())
    pool = manager.block_pool
    assert type(pool.free_block_queue) is FreeKVCacheBlockQueue
    assert pool.eviction_policy is None and pool.host_tier is None
    assert type(policy_manager("lru", 8, BS).block_pool.free_block_queue) is FreeKVCacheBlockQueue


@pytest.mark.parametrize("policy", ALL_POLICIES[1:])
def test_other_policies_are_policy_objects(policy):
    pool = policy_manager(policy, 8, BS).block_pool
    assert isinstance(pool.free_block_queue, EvictionPolicy)
    assert pool.eviction_policy is pool.free_block_queue
    assert pool.eviction_policy.name == policy


def test_bad_eviction_configs_are_refused_with_the_value():
    with pytest.raises(ConfigError, match="'mru'"):
        EvictionConfig(policy="mru")
    with pytest.raises(ConfigError, match="needs an oracle"):
        EvictionConfig(policy="belady")
    with pytest.raises(ConfigError, match="only belady takes one"):
        EvictionConfig(policy="lfu", oracle=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="max_retained_fraction=1.5"):
        EvictionConfig(max_retained_fraction=1.5)
    with pytest.raises(ConfigError, match="host_num_blocks=-1"):
        EvictionConfig(host_num_blocks=-1)
    with pytest.raises(ConfigError, match="'lfu '"):
        policy_manager("lru", 8, BS, eviction="lfu ")


# ---------------------------------------------------------------------------- shared scenarios


@pytest.mark.parametrize("param", ALL_CONFIGS)
def test_reference_prefill_scenario(param):
    """The reference's test_prefill (11 blocks, block size 16) under every policy: identical
    until eviction; then unhashed blocks go first and every cached block goes once."""
    manager = manager_for(param, 11, 16)
    mirror = EventMirror()
    common = list(range(48))
    r0 = make_request("r0", common + [100] * 7, 16)
    assert admit(manager, r0) == ([1, 2, 3, 4], 0)
    r1 = make_request("r1", common + [200] * 5, 16)
    assert admit(manager, r1) == ([5], 48)
    manager.free(r0)
    manager.free(r1)
    manager.check_invariants()
    free_ids = manager.block_pool.free_block_ids()
    assert free_ids[:7] == [5, 4, 6, 7, 8, 9, 10]
    assert sorted(free_ids[7:]) == [1, 2, 3]
    mirror.apply(manager.take_events())
    r3 = make_request("r3", list(range(1000, 1160)), 16)
    new_ids, num_hit = admit(manager, r3)
    assert num_hit == 0 and new_ids[:7] == [5, 4, 6, 7, 8, 9, 10]
    assert sorted(new_ids[7:]) == [1, 2, 3]
    events = manager.take_events()
    removed = [event for event in events if type(event) is BlockRemoved]
    assert len(removed) == 3 and all(len(event.block_hashes) == 1 for event in removed)
    assert {event.block_hashes[0] for event in removed} == set(r0.block_hashes[:3])
    mirror.apply(events)
    assert mirror.hashes("GPU") == pool_hash_counts(manager)
    manager.check_invariants()


@pytest.mark.parametrize("param", ALL_CONFIGS)
def test_unhashed_blocks_are_reused_before_any_cached_block(param):
    manager = manager_for(param, 10)
    run(manager, "a", list(range(13)))  # blocks 1-3 cached, 4 partial
    free_ids = manager.block_pool.free_block_ids()
    assert free_ids[:6] == [4, 5, 6, 7, 8, 9]
    assert sorted(free_ids[6:]) == [1, 2, 3]
    new_ids, _ = run(manager, "b", list(range(100, 124)))  # six blocks: no eviction
    assert new_ids == [4, 5, 6, 7, 8, 9]
    assert not [e for e in manager.take_events() if type(e) is BlockRemoved]


@pytest.mark.parametrize("param", ALL_CONFIGS)
def test_held_blocks_are_never_evicted_and_a_full_pool_refuses(param):
    manager = manager_for(param, 10)
    run(manager, "a", list(range(16)))  # 1-4 cached and free
    holder = make_request("holder", list(range(12)) + [99], BS)
    assert admit(manager, holder) == ([5], 12)  # holds 1-3 (hits) and 5
    other = make_request("other", list(range(500, 520)), BS)  # five blocks: 4 must go
    new_ids, _ = admit(manager, other)
    assert sorted(new_ids) == [4, 6, 7, 8, 9]
    removed = [e for e in manager.take_events() if type(e) is BlockRemoved]
    assert len(removed) == 1
    too_big = make_request("too-big", list(range(900, 904)), BS)
    assert admit(manager, too_big) == (None, 0)
    manager.check_invariants()
    assert manager.get_block_ids("holder") == ([1, 2, 3, 5],)


@pytest.mark.parametrize("param", ALL_CONFIGS)
def test_evict_blocks_makes_a_free_cached_block_reusable_first(param):
    manager = manager_for(param, 8)
    run(manager, "a", list(range(16)))  # 1-4 cached and free
    before = manager.block_pool.free_block_ids()
    refs = [block.ref_cnt for block in manager.block_pool.blocks]
    manager.evict_blocks({2})
    manager.check_invariants()
    after = manager.block_pool.free_block_ids()
    assert sorted(after) == sorted(before)
    assert [block.ref_cnt for block in manager.block_pool.blocks] == refs
    assert manager.block_pool.blocks[2].block_hash is None
    if manager.block_pool.eviction_policy is None:
        assert after == before  # the reference keeps the block in place
    else:
        assert after[0] == 2  # unhashed now: reused before every cached block
    events = manager.take_events()
    assert [type(e) for e in events][-1] is BlockRemoved


@pytest.mark.parametrize("param", ALL_CONFIGS)
def test_reset_prefix_cache_leaves_only_unhashed_blocks(param):
    manager = manager_for(param, 8)
    run(manager, "a", list(range(16)))
    run(manager, "b", list(range(50, 62)))
    assert manager.reset_prefix_cache()
    manager.check_invariants()
    pool = manager.block_pool
    assert pool.num_cached_blocks() == 0
    assert sorted(pool.free_block_ids()) == list(range(1, 8))
    assert type(manager.take_events()[-1]) is AllBlocksCleared
    new_ids, num_hit = run(manager, "c", list(range(16)))
    assert num_hit == 0 and len(new_ids) == 4


@pytest.mark.parametrize("param", ALL_CONFIGS)
def test_events_mirror_the_cache_on_a_random_workload(param):
    """Applying every event (stored / removed) to a multiset reproduces the pool's cached
    hashes after every request, for every policy; hits never exceed the prompt."""
    manager = manager_for(param, 24)
    mirror = EventMirror()
    rng = random.Random(7)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    for index in range(150):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 24))]
        new_ids, num_hit = run(manager, f"r{index}", tokens)
        assert num_hit <= len(tokens) - 1 and num_hit % BS == 0
        if index % 37 == 36:
            manager.evict_blocks({5, 6})
        events = manager.take_events()
        assert {type(e) for e in events} <= {BlockStored, BlockRemoved}
        mirror.apply(events)
        assert mirror.hashes("GPU") == pool_hash_counts(manager)


def test_policies_differ_only_in_which_cached_block_goes():
    """Same workload: every policy serves every request, evicts only when the unhashed blocks
    run out, and the number of blocks evicted equals the number of misses cached."""
    rng = random.Random(3)
    prefixes = [[rng.randrange(50) for _ in range(16)] for _ in range(5)]
    workload = [
        rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 20))]
        for _ in range(200)
    ]
    results = {}
    for policy in ALL_POLICIES:
        manager = policy_manager(policy, 20, BS, enable_kv_cache_events=True)
        num_hit_tokens = 0
        num_removed = num_stored = 0
        for index, tokens in enumerate(workload):
            _, num_hit = run(manager, f"r{index}", tokens)
            num_hit_tokens += num_hit
            for event in manager.take_events():
                if type(event) is BlockRemoved:
                    num_removed += len(event.block_hashes)
                elif type(event) is BlockStored:
                    num_stored += len(event.block_hashes)
        assert num_stored - num_removed == manager.block_pool.num_cached_blocks()
        results[policy] = num_hit_tokens
    assert all(hits > 0 for hits in results.values())


def test_negative_pop_is_refused_by_every_free_block_set():
    for policy in ALL_POLICIES:
        free = policy_manager(policy, 6, BS).block_pool.free_block_queue
        with pytest.raises(InvalidArgumentError, match="-1"):
            free.popleft_n(-1)
        with pytest.raises(InvalidArgumentError, match="only 5"):
            free.popleft_n(6)


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_batched_victims_equal_one_at_a_time(policy):
    """`popleft_n(n)` takes victims in batches where it can: the same blocks, in the same
    order, leaving the same state, as n calls of `popleft_n(1)` after the same history."""
    rng = random.Random(11)
    prefixes = [[rng.randrange(40) for _ in range(8)] for _ in range(3)]
    workload = [
        rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randrange(1, 30))]
        for _ in range(120)
    ]
    pools = []
    for _ in range(2):
        manager = manager_for((policy, False), 60)
        held = []
        for index, tokens in enumerate(workload):
            request = make_request(f"r{index}", tokens, BS)
            assert admit(manager, request)[0] is not None
            held.append(request)
            if index % 3:  # some requests keep their blocks a while: hits on held blocks
                for request in held:
                    manager.free(request)
                held.clear()
        pools.append(manager.block_pool)
    batched, single = pools
    free = batched.get_num_free_blocks()
    listed = batched.free_block_ids()
    order = [b.block_id for b in batched.get_new_blocks(free)]
    if policy != "belady":  # belady lists a waiting parent before it gets its key
        assert order == listed  # free_block_ids() is the exact reuse order
    one_by_one = [single.get_new_blocks(1)[0].block_id for _ in range(free)]
    assert order == one_by_one
    assert batched.take_events() == single.take_events()
    batched.check_invariants()
    single.check_invariants()
