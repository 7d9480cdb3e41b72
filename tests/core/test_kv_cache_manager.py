"""KVCacheManager prefix-caching scenarios with exact block ids and free-queue order.

Ports the expectations of the reference's tests/v1/core/test_prefix_caching.py (as REFERENCE.md
describes them for 0.32: unhashed blocks freed to the head, hashed ones to the tail).
"""

from __future__ import annotations

import pytest

from pagedkv import InvariantViolation, KVCacheBlocks, RequestStatus
from tests.support.builders import admit, free_ids, make_manager, make_request, snapshot

COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16


def table(manager, request_id: str) -> list[int]:
    return manager.get_block_ids(request_id)[0]


def test_prefill_then_reuse(manager):
    """The reference's test_prefill (11 blocks, block size 16)."""
    r0 = make_request("0", COMMON + [3] * 7)
    hits, num_hit_tokens, boundary = manager.get_computed_blocks(r0)
    assert len(r0.block_hashes) == 3
    assert hits is manager.empty_kv_cache_blocks and num_hit_tokens == 0 and boundary == 0
    new = manager.allocate_slots(r0, 55, 0, hits)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    pool = manager.block_pool
    assert [pool.blocks[i].block_hash for i in (1, 2, 3)] == r0.block_hashes
    assert pool.blocks[4].block_hash is None  # 7 tokens: not full
    manager.check_invariants()

    r1 = make_request("1", COMMON + [3] * 5)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hit_tokens == 48
    assert manager.allocate_slots(r1, 5, 48, hits).get_block_ids() == ([5],)
    assert [pool.blocks[i].ref_cnt for i in range(1, 6)] == [2, 2, 2, 1, 1]
    assert pool.get_num_free_blocks() == 5
    assert table(manager, "1") == [1, 2, 3, 5]
    manager.check_invariants()

    manager.free(r0)
    manager.free(r1)
    assert free_ids(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    manager.check_invariants()

    r2 = make_request("2", COMMON + [3] * 6)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r2)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hit_tokens == 48
    assert manager.allocate_slots(r2, 6, 48, hits).get_block_ids() == ([5],)
    manager.free(r2)
    assert free_ids(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]

    r3 = make_request("3", [99] * 160)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r3)
    assert num_hit_tokens == 0
    new = manager.allocate_slots(r3, 160, 0, hits)
    assert new.get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert manager.block_pool.get_num_free_blocks() == 0
    # Every old cache entry was evicted on reuse; r3 cached its own 10 blocks.
    assert manager.block_pool.num_cached_blocks() == 10
    assert manager.get_computed_blocks(make_request("x", COMMON + [3])).num_computed_tokens == 0
    manager.free(r3)
    assert manager.block_pool.get_num_free_blocks() == 10
    manager.check_invariants()


def test_decode_appends(manager):
    """The reference's test_decode: decode tokens fill the last block, then a new one."""
    r0 = make_request("0", COMMON + [3] * 7)
    assert admit(manager, r0) == ([1, 2, 3, 4], 0)
    for _ in range(4):
        r0.append_output_token_ids(8)
    new = manager.allocate_slots(r0, 4)
    assert new is manager.empty_kv_cache_blocks
    assert new.get_block_ids() == ([],)
    blocks = manager.get_blocks("0").blocks[0]
    assert blocks[-1].block_hash is None  # 59 tokens: block 4 still partial
    r0.num_computed_tokens = 59
    for _ in range(9 + 10):
        r0.append_output_token_ids(7)
    new = manager.allocate_slots(r0, 19)
    assert new.get_block_ids() == ([5],)
    blocks = manager.get_blocks("0").blocks[0]
    assert [b.block_id for b in blocks] == [1, 2, 3, 4, 5]
    assert blocks[-2].block_hash == r0.block_hashes[3]  # now full (64 tokens), cached
    assert blocks[-1].block_hash is None
    assert manager.coordinator.single_type_managers[0].num_cached_block["0"] == 4
    manager.check_invariants()


def test_decode_one_token_at_a_time_crosses_block_boundary():
    manager = make_manager(6, 4)
    req = make_request("r", [1, 2, 3], 4)
    assert admit(manager, req) == ([1], 0)
    req.append_output_token_ids(4)
    assert manager.allocate_slots(req, 1).get_block_ids() == ([],)
    req.num_computed_tokens = 4
    req.append_output_token_ids(5)
    assert manager.allocate_slots(req, 1).get_block_ids() == ([2],)
    req.num_computed_tokens = 5
    assert manager.block_pool.blocks[1].block_hash == req.block_hashes[0]
    assert table(manager, "r") == [1, 2]
    manager.check_invariants()


def test_lru_order_across_requests(manager):
    """The reference's test_evict, under 0.32 free ordering."""
    r0 = make_request("0", list(range(5 * 16 + 7)))
    assert admit(manager, r0) == ([1, 2, 3, 4, 5, 6], 0)
    r1 = make_request("1", list(range(87, 87 + 3 * 16)))
    assert admit(manager, r1) == ([7, 8, 9], 0)
    manager.free(r0)
    manager.free(r1)
    # r0: unhashed 6 to the head, 5..1 to the tail; r1: 9 8 7 (all hashed) after them.
    assert free_ids(manager) == [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]
    r2 = make_request("2", list(range(2 * 16 + 3)))
    assert admit(manager, r2) == ([6], 32)
    assert table(manager, "2") == [1, 2, 6]
    assert free_ids(manager) == [10, 5, 4, 3, 9, 8, 7]
    manager.check_invariants()


def test_reused_block_hash_reset():
    """The reference's test_hash_block_correct_reuse: a reused block forgets its old hash."""
    manager = make_manager(2, 16)
    r0 = make_request("0", list(range(16)))
    assert admit(manager, r0) == ([1], 0)
    assert manager.block_pool.blocks[1].block_hash == r0.block_hashes[0]
    manager.free(r0)
    r1 = make_request("1", list(range(15)))
    assert manager.get_computed_blocks(r1).num_computed_tokens == 0
    assert admit(manager, r1) == ([1], 0)
    assert manager.block_pool.blocks[1].block_hash is None
    assert manager.block_pool.num_cached_blocks() == 0
    manager.check_invariants()


def test_hit_blocks_not_evicted_by_their_own_allocation():
    """The reference's test_computed_blocks_not_evicted."""
    manager = make_manager(3, 16)
    r0 = make_request("0", list(range(16)))
    assert admit(manager, r0) == ([1], 0)
    r1 = make_request("1", list(range(16, 32)))
    assert admit(manager, r1) == ([2], 0)
    manager.free(r0)
    manager.free(r1)
    assert free_ids(manager) == [1, 2]
    r2 = make_request("2", list(range(32)))
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r2)
    assert hits.get_block_ids() == ([1],) and num_hit_tokens == 16
    # Block 1 sits at the head of the free queue; it is touched before block 2 is popped.
    new = manager.allocate_slots(r2, 16, 16, hits)
    assert new.get_block_ids() == ([2],)
    assert table(manager, "2") == [1, 2]
    assert manager.block_pool.blocks[1].block_hash == r2.block_hashes[0]
    manager.check_invariants()


def test_caching_disabled():
    """The reference's test_basic_prefix_caching_disabled (0.32: freed blocks to the head)."""
    manager = make_manager(5, 4, enable_caching=False)
    r1 = make_request("1", list(range(1, 11)), 4, hashed=False)
    assert admit(manager, r1) == ([1, 2, 3], 0)
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    manager.free(r1)
    assert free_ids(manager) == [3, 2, 1, 4]
    r2 = make_request("2", list(range(1, 11)), 4, hashed=False)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r2)
    assert hits is manager.empty_kv_cache_blocks and num_hit_tokens == 0
    assert admit(manager, r2) == ([3, 2, 1], 0)
    r3 = make_request("3", list(range(4)), 4, hashed=False)
    assert admit(manager, r3) == ([4], 0)
    r4 = make_request("4", list(range(4)), 4, hashed=False)
    assert manager.allocate_slots(r4, 4) is None
    assert manager.block_pool.num_cached_blocks() == 0
    manager.check_invariants()


def test_caching_disabled_accepts_hashed_requests_and_never_caches():
    manager = make_manager(5, 4, enable_caching=False, enable_kv_cache_events=True)
    req = make_request("1", list(range(8)), 4)
    assert admit(manager, req) == ([1, 2], 0)
    assert manager.block_pool.num_cached_blocks() == 0
    manager.cache_blocks(req, 8)  # a no-op with caching off
    assert manager.block_pool.num_cached_blocks() == 0
    assert manager.take_events() == []


def test_skip_reading_prefix_cache_still_writes(manager):
    """Prompt-logprob requests (skip_reading_prefix_cache) miss but still cache their blocks."""
    r0 = make_request("0", COMMON + [3] * 7)
    assert admit(manager, r0) == ([1, 2, 3, 4], 0)
    r1 = make_request("1", COMMON + [3] * 7, skip_reading_prefix_cache=True)
    assert not manager.prefix_cache_lookup_enabled(r1)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    assert hits is manager.empty_kv_cache_blocks and num_hit_tokens == 0
    assert admit(manager, r1) == ([5, 6, 7, 8], 0)
    # r1's full blocks are cached as duplicates of r0's; the first cached still wins.
    cached = manager.block_pool.cached_hashes(0)
    assert [cached[h] for h in r0.block_hashes] == [[1, 5], [2, 6], [3, 7]]
    manager.free(r0)
    manager.free(r1)
    assert free_ids(manager) == [8, 4, 9, 10, 3, 2, 1, 7, 6, 5]
    r2 = make_request("2", COMMON + [3] * 7)
    assert admit(manager, r2) == ([8], 48)
    assert table(manager, "2") == [1, 2, 3, 8]
    # A skipping request that is itself the only writer makes the cache usable for others.
    r3 = make_request("3", [5] * 33, skip_reading_prefix_cache=True)
    assert admit(manager, r3) == ([4, 9, 10], 0)
    r4 = make_request("4", [5] * 40)
    assert manager.get_computed_blocks(r4).blocks.get_block_ids() == ([4, 9],)
    manager.check_invariants()


def test_not_enough_blocks_with_evictable_hits(manager):
    """The reference's test_prefill_not_enough_free_blocks_with_computed_blocks."""
    r0 = make_request("0", COMMON)
    assert admit(manager, r0) == ([1, 2, 3], 0)
    r1 = make_request("1", COMMON * 2)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hit_tokens == 48
    assert manager.allocate_slots(r1, 48, 48, hits).get_block_ids() == ([4, 5, 6],)
    manager.free(r1)
    pool = manager.block_pool
    assert [pool.blocks[i].ref_cnt for i in range(1, 7)] == [1, 1, 1, 0, 0, 0]
    r2 = make_request("2", [7] * 32)
    assert admit(manager, r2) == ([7, 8], 0)
    assert pool.get_num_free_blocks() == 5
    assert free_ids(manager) == [9, 10, 6, 5, 4]

    r3 = make_request("3", COMMON * 3)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r3)
    assert hits.get_block_ids() == ([1, 2, 3, 4, 5, 6],) and num_hit_tokens == 96
    before = snapshot(manager)
    # 3 new blocks + 3 evictable hit blocks (ref 0) = 6 > 5 free.
    assert manager.allocate_slots(r3, 48, 96, hits) is None
    assert snapshot(manager) == before
    assert [pool.blocks[i].ref_cnt for i in range(1, 7)] == [1, 1, 1, 0, 0, 0]
    # Freeing r2 makes room: the same (still valid) lookup result now fits.
    manager.free(r2)
    assert free_ids(manager) == [9, 10, 6, 5, 4, 8, 7]  # r2's full blocks were cached
    new = manager.allocate_slots(r3, 48, 96, hits)
    assert new.get_block_ids() == ([9, 10, 8],)
    assert table(manager, "3") == [1, 2, 3, 4, 5, 6, 9, 10, 8]
    manager.check_invariants()


def test_48_token_prompt_hits_only_32(manager):
    r0 = make_request("0", COMMON)
    assert admit(manager, r0) == ([1, 2, 3], 0)
    r1 = make_request("1", COMMON)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    # A full hit must leave one token to compute, and hits are whole blocks.
    assert hits.get_block_ids() == ([1, 2],) and num_hit_tokens == 32
    assert manager.allocate_slots(r1, 16, 32, hits).get_block_ids() == ([4],)
    # Block 4 holds the same tokens as block 3: cached as a duplicate, 3 stays first.
    assert manager.block_pool.cached_hashes(0)[r0.block_hashes[2]] == [3, 4]
    r2 = make_request("2", COMMON + [9])
    assert manager.get_computed_blocks(r2).blocks.get_block_ids() == ([1, 2, 3],)
    manager.check_invariants()


def test_partial_prefix_hit_stops_at_first_miss(manager):
    r0 = make_request("0", COMMON + [3] * 16)
    assert admit(manager, r0) == ([1, 2, 3, 4], 0)
    # Same first and third block tokens, different second block: only block 1 hits.
    r1 = make_request("1", [0] * 16 + [5] * 16 + [2] * 16 + [3] * 17)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    assert hits.get_block_ids() == ([1],) and num_hit_tokens == 16


def test_reset_prefix_cache_refused_while_held(manager):
    """The reference's test_reset_prefix_cache."""
    r0 = make_request("0", COMMON + [3] * 7)
    assert manager.allocate_slots(r0, 55).get_block_ids() == ([1, 2, 3, 4],)
    r1 = make_request("1", COMMON + [4] * 7)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    assert len(r1.block_hashes) == 3 and len(hits.blocks[0]) == 3
    assert manager.allocate_slots(r1, 7, num_hit_tokens, hits).get_block_ids() == ([5],)
    before = snapshot(manager)
    assert manager.reset_prefix_cache() is False
    assert snapshot(manager) == before
    assert manager.block_pool.num_cached_blocks() == 3
    manager.free(r0)
    manager.free(r1)
    assert manager.reset_prefix_cache() is True
    assert manager.block_pool.num_cached_blocks() == 0
    assert manager.block_pool.hash_to_block == [{}]
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    r2 = make_request("2", COMMON + [3])
    assert manager.get_computed_blocks(r2).num_computed_tokens == 0
    manager.check_invariants()


def test_preempt_and_readmit_hits_own_prefix(manager):
    req = make_request("r", COMMON + [3] * 7)
    assert admit(manager, req) == ([1, 2, 3, 4], 0)
    for token in range(9):
        req.append_output_token_ids(token)
    assert manager.allocate_slots(req, 9).get_block_ids() == ([],)
    req.num_computed_tokens = 64
    # Preemption as the scheduler does it.
    manager.free(req)
    req.status = RequestStatus.PREEMPTED
    req.num_computed_tokens = 0
    req.num_preemptions += 1
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    hits, num_hit_tokens, _ = manager.get_computed_blocks(req)
    # 64 tokens, all cached, but one must be recomputed: the last block is dropped.
    assert hits.get_block_ids() == ([1, 2, 3],) and num_hit_tokens == 48
    assert manager.allocate_slots(req, 16, 48, hits).get_block_ids() == ([5],)
    assert table(manager, "r") == [1, 2, 3, 5]
    assert manager.block_pool.cached_hashes(0)[req.block_hashes[3]] == [4, 5]
    manager.check_invariants()


def test_chunked_prefill_caches_each_chunk(manager):
    req = make_request("r", list(range(70)))
    assert manager.allocate_slots(req, 20).get_block_ids() == ([1, 2],)
    assert manager.block_pool.num_cached_blocks() == 1
    req.num_computed_tokens = 20
    assert manager.allocate_slots(req, 30).get_block_ids() == ([3, 4],)
    assert manager.block_pool.num_cached_blocks() == 3
    req.num_computed_tokens = 50
    assert manager.allocate_slots(req, 20).get_block_ids() == ([5],)
    assert manager.block_pool.num_cached_blocks() == 4
    assert manager.coordinator.single_type_managers[0].num_cached_block["r"] == 4
    manager.check_invariants()


def test_delay_cache_blocks_then_cache_blocks(manager):
    req = make_request("r", COMMON + [3])
    new = manager.allocate_slots(req, 49, delay_cache_blocks=True)
    assert new.get_block_ids() == ([1, 2, 3, 4],)
    assert manager.block_pool.num_cached_blocks() == 0
    manager.cache_blocks(req, 32)
    assert manager.block_pool.cached_hashes(0) == {
        req.block_hashes[0]: [1],
        req.block_hashes[1]: [2],
    }
    manager.cache_blocks(req, 49)
    assert manager.block_pool.num_cached_blocks() == 3
    manager.check_invariants()


def test_pop_blocks_for_free_then_deferred_free(manager):
    r0 = make_request("0", COMMON + [3] * 7)
    assert admit(manager, r0) == ([1, 2, 3, 4], 0)
    free_before = free_ids(manager)
    popped = manager.pop_blocks_for_free(r0)
    assert [b.block_id for b in popped] == [1, 2, 3, 4]
    assert [b.ref_cnt for b in popped] == [1, 1, 1, 1]
    assert free_ids(manager) == free_before
    assert manager.get_block_ids("0") == ([],)
    assert manager.coordinator.single_type_managers[0].num_cached_block == {}
    manager.check_invariants(held_outside=popped)
    # The popped prefix is still cached: another request can share it meanwhile.
    r1 = make_request("1", COMMON + [3])
    assert admit(manager, r1) == ([5], 48)
    manager.check_invariants(held_outside=popped)
    manager.block_pool.free_blocks(reversed(popped))
    manager.free(r1)
    assert free_ids(manager) == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    manager.check_invariants()
    # Popping an unknown request returns nothing.
    assert manager.pop_blocks_for_free(make_request("zz", [1])) == []


def test_get_num_common_prefix_blocks(manager):
    r0 = make_request("0", COMMON + [3] * 7)
    assert admit(manager, r0) == ([1, 2, 3, 4], 0)
    assert manager.get_num_common_prefix_blocks("0") == [4]  # the only holder: every block
    r1 = make_request("1", COMMON[:32] + [8] * 5)
    assert admit(manager, r1) == ([5], 32)
    assert table(manager, "1") == [1, 2, 5]
    assert manager.get_num_common_prefix_blocks("0") == [2]
    assert manager.get_num_common_prefix_blocks("1") == [2]
    r2 = make_request("2", [50] * 20)
    assert admit(manager, r2) == ([6, 7], 0)
    # Block 1 is not held by r2, so nothing is common to every running request.
    assert manager.get_num_common_prefix_blocks("0") == [0]
    manager.free(r2)
    assert manager.get_num_common_prefix_blocks("1") == [2]
    manager.free(r0)
    assert manager.get_num_common_prefix_blocks("1") == [3]
    assert manager.get_num_common_prefix_blocks("nobody") == [0]


def test_free_unknown_request_is_a_no_op(manager):
    r0 = make_request("0", COMMON)
    admit(manager, r0)
    before = snapshot(manager)
    manager.free(make_request("nobody", [1, 2, 3]))
    assert snapshot(manager) == before


def test_get_blocks_of_unknown_request(manager):
    assert manager.get_blocks("nobody") is manager.empty_kv_cache_blocks
    assert manager.get_block_ids("nobody") == ([],)


def test_usage(manager):
    assert manager.usage == 0.0
    r0 = make_request("0", COMMON + [3] * 7)
    admit(manager, r0)
    assert manager.usage == 0.4
    manager.free(r0)
    assert manager.usage == 0.0  # cached-but-free blocks count as free


def test_kv_cache_blocks_helpers(manager):
    r0 = make_request("0", COMMON + [3] * 7)
    admit(manager, r0)
    blocks = manager.get_blocks("0")
    pool = manager.block_pool
    assert blocks.get_block_ids() == ([1, 2, 3, 4],)
    assert blocks.get_unhashed_block_ids() == [4]
    assert blocks.get_unhashed_block_ids_all_groups() == [[4]]
    empty = blocks.new_empty()
    assert empty.blocks == ((),)
    assert empty.get_block_ids(allow_none=True) is None
    assert empty.get_block_ids() == ([],)
    assert blocks.get_block_ids(allow_none=True) == ([1, 2, 3, 4],)
    combined = blocks + KVCacheBlocks(([pool.blocks[7]],))
    assert combined.get_block_ids() == ([1, 2, 3, 4, 7],)
    assert isinstance(combined.blocks[0], list)
    two = KVCacheBlocks(([pool.blocks[1]], [pool.null_block, pool.blocks[9]]))
    assert two.get_block_ids(group_ids=[1, 0]) == ([0, 9], [1])
    assert two.get_block_ids(group_ids=[1]) == ([0, 9],)
    assert two.get_unhashed_block_ids_all_groups() == [[], [9]]
    assert KVCacheBlocks(((), ())).get_block_ids(allow_none=True, group_ids=[0]) is None


# ---------------------------------------------------------------------------- check_invariants


def corrupt_ref_count(manager, pool):
    pool.blocks[2].ref_cnt += 1  # held by one table, counted twice


def corrupt_unknown_holder(manager, pool):
    manager.coordinator.single_type_managers[0].req_to_blocks["ghost"] = [pool.blocks[1]]
    pool.blocks[1].ref_cnt += 1


def corrupt_hash_of_held_block(manager, pool):
    # Re-key block 2 under block 1's hash (both map entries kept consistent for the pool).
    hash_map = pool.hash_to_block[0]
    del hash_map[pool.blocks[2].block_hash]
    pool.blocks[2].block_hash = pool.blocks[3].block_hash
    pool._duplicates[0][pool.blocks[3].block_hash] = {2: pool.blocks[2]}


def corrupt_num_cached_block(manager, pool):
    manager.coordinator.single_type_managers[0].num_cached_block["0"] = 9


def corrupt_foreign_block(manager, pool):
    from pagedkv import KVCacheBlock

    table = manager.coordinator.single_type_managers[0].req_to_blocks["0"]
    table[3] = KVCacheBlock(4, ref_cnt=1)


@pytest.mark.parametrize(
    "corrupt",
    [
        corrupt_ref_count,
        corrupt_unknown_holder,
        corrupt_hash_of_held_block,
        corrupt_num_cached_block,
        corrupt_foreign_block,
    ],
    ids=lambda f: f.__name__,
)
def test_manager_check_invariants_catches_corruption(manager, corrupt):
    r0 = make_request("0", COMMON + [3] * 7)
    admit(manager, r0)
    manager.check_invariants()
    corrupt(manager, manager.block_pool)
    with pytest.raises(InvariantViolation):
        manager.check_invariants()


def test_evicted_held_block_keeps_invariants(manager):
    r0 = make_request("0", COMMON + [3] * 7)
    admit(manager, r0)
    manager.evict_blocks({2})
    assert manager.block_pool.blocks[2].block_hash is None
    manager.check_invariants()
    manager.free(r0)
    # Unhashed now, block 2 joins block 4 at the head (in reverse table order).
    assert free_ids(manager) == [4, 2, 5, 6, 7, 8, 9, 10, 3, 1]
    manager.check_invariants()
