"""One contract every per-attention-type manager passes (allocate, free, cache, skipped blocks,
invariants), run against each manager class with exact block ids.

Mamba is not in it: in the reference's "align" mode a step holds a real block only at its last
position, so "the table covers the tokens" does not hold; tests/hybrid/test_mamba.py pins it."""

from __future__ import annotations

import pytest

from pagedkv import BlockPool, ConfigError, InvariantViolation
from pagedkv.managers import (
    ChunkedLocalAttentionManager,
    CrossAttentionManager,
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    manager_class_for,
)
from pagedkv.specs import cdiv
from tests.support.hybrid import chunked, cross, full, ids, make_request, swa

BLOCK_SIZE = 4
NUM_BLOCKS = 32
MAX_MODEL_LEN = 256

# kind -> (spec, expected manager class, hit ids before caching, hit ids after caching 18 tokens)
CASES = {
    "full": (full(BLOCK_SIZE), FullAttentionManager, [], [1, 2, 3, 4]),
    "sliding_window": (swa(BLOCK_SIZE, 8), SlidingWindowManager, [], [0, 0, 3, 4]),
    "chunked_local": (
        chunked(BLOCK_SIZE, 12),
        ChunkedLocalAttentionManager,
        [0, 0, 0],
        [0, 0, 0, 4],
    ),
    "cross_attention": (cross(BLOCK_SIZE), CrossAttentionManager, None, None),
}


@pytest.fixture(params=list(CASES))
def kind(request) -> str:
    return request.param


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(NUM_BLOCKS, enable_caching=True, hash_block_size=BLOCK_SIZE)


@pytest.fixture
def manager(kind: str, pool: BlockPool) -> SingleTypeKVCacheManager:
    spec = CASES[kind][0]
    return manager_class_for(spec)(
        spec,
        pool,
        0,
        enable_caching=spec.prefix_cacheable,
        max_admission_blocks_per_request=spec.max_admission_blocks(MAX_MODEL_LEN, MAX_MODEL_LEN),
    )


def check(manager: SingleTypeKVCacheManager) -> None:
    """Pool and manager invariants, and ref counts equal to the number of tables holding a block."""
    manager.block_pool.check_invariants()
    manager.check_invariants()
    holders: dict[int, int] = {}
    for blocks in manager.req_to_blocks.values():
        for block in blocks:
            if not block.is_null:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
    for block in manager.block_pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block


def real_ids(blocks) -> list[int]:
    return [block.block_id for block in blocks if not block.is_null]


def test_dispatch_picks_the_manager_class(kind: str, manager: SingleTypeKVCacheManager) -> None:
    assert type(manager) is CASES[kind][1]


def test_allocate_covers_the_tokens_and_counts_exactly(manager: SingleTypeKVCacheManager) -> None:
    pool = manager.block_pool
    num_free = pool.get_num_free_blocks()
    predicted = manager.get_num_blocks_to_allocate("r", 13, (), 0)
    new_blocks = manager.allocate_new_blocks("r", 13)
    assert ids(new_blocks) == [1, 2, 3, 4]
    assert predicted == 4 == num_free - pool.get_num_free_blocks()
    assert ids(manager.req_to_blocks["r"]) == [1, 2, 3, 4]
    assert all(block.ref_cnt == 1 for block in new_blocks)
    # Enough room already: nothing new, and the count agrees.
    assert manager.get_num_blocks_to_allocate("r", 16, (), 0) == 0
    assert manager.allocate_new_blocks("r", 16) == []
    check(manager)


def test_growing_request_matches_predictions(manager: SingleTypeKVCacheManager) -> None:
    """Chunked prefill then decode, freeing skipped blocks on the processed basis each step."""
    pool = manager.block_pool
    request = make_request("r", range(40), BLOCK_SIZE)
    num_computed = 0
    for num_new in (6, 7, 5, 1, 1, 1, 1, 1, 1, 1, 1):
        manager.remove_skipped_blocks("r", num_computed)
        num_skipped_blocks = manager.get_num_skipped_tokens(num_computed) // BLOCK_SIZE
        num_free = pool.get_num_free_blocks()
        predicted = manager.get_num_blocks_to_allocate(
            "r", num_computed + num_new, (), num_computed
        )
        new_blocks = manager.allocate_new_blocks("r", num_computed + num_new)
        assert predicted == len(new_blocks) == num_free - pool.get_num_free_blocks()
        if manager.enable_caching:
            manager.cache_blocks(request, num_computed + num_new)
        num_computed += num_new
        table = manager.req_to_blocks["r"]
        assert len(table) == cdiv(num_computed, BLOCK_SIZE)
        assert all(block.is_null for block in table[:num_skipped_blocks])
        assert not any(block.is_null for block in table[num_skipped_blocks:])
        check(manager)
    manager.free("r")
    assert "r" not in manager.req_to_blocks and "r" not in manager.num_cached_block
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    check(manager)


def test_free_releases_in_reverse_order(manager: SingleTypeKVCacheManager) -> None:
    pool = manager.block_pool
    manager.allocate_new_blocks("r", 10)
    manager.free("r")
    # Unhashed blocks go to the head in the order freed: the table's tail first.
    assert pool.free_block_ids()[:3] == [3, 2, 1]
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    manager.free("r")  # a second free, or an unknown request, is a no-op
    manager.free("never-allocated")
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    check(manager)


def test_pop_blocks_for_free_defers_the_free(manager: SingleTypeKVCacheManager) -> None:
    pool = manager.block_pool
    manager.allocate_new_blocks("r", 9)
    blocks = manager.pop_blocks_for_free("r")
    assert ids(blocks) == [1, 2, 3]
    assert "r" not in manager.req_to_blocks
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 4
    pool.free_blocks(reversed(blocks))
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
    assert manager.pop_blocks_for_free("r") == []
    check(manager)


def test_cache_then_hit(kind: str, manager: SingleTypeKVCacheManager) -> None:
    pool = manager.block_pool
    spec, _, expected_before, expected_after = CASES[kind]
    request = make_request("r", range(18), BLOCK_SIZE)
    manager.allocate_new_blocks("r", 18)
    if expected_before is None:
        with pytest.raises(ConfigError, match="never prefix-cached"):
            manager.find_longest_cache_hit(request.block_hashes, 17, (0,), pool, spec, BLOCK_SIZE)
        with pytest.raises(ConfigError, match="enable_caching=False"):
            manager.cache_blocks(request, 18)
        assert pool.num_cached_blocks() == 0
        check(manager)
        return
    hits, num_hit_tokens = manager.find_longest_cache_hit(
        request.block_hashes, 17, (0,), pool, spec, BLOCK_SIZE
    )
    assert (ids(hits[0]), num_hit_tokens) == (expected_before, len(expected_before) * BLOCK_SIZE)
    manager.cache_blocks(request, 18)
    manager.new_step_starts()
    assert manager.num_cached_block["r"] == 4
    assert sorted(b for ids_ in pool.cached_hashes(0).values() for b in ids_) == [1, 2, 3, 4]
    hits, num_hit_tokens = manager.find_longest_cache_hit(
        request.block_hashes, 17, (0,), pool, spec, BLOCK_SIZE
    )
    assert ids(hits[0]) == expected_after
    assert num_hit_tokens == 16
    for position, block in enumerate(hits[0]):
        if not block.is_null:
            assert block.block_hash == request.block_hashes[position]
    check(manager)


def test_remove_skipped_blocks_frees_longest_prefix_first(
    kind: str, manager: SingleTypeKVCacheManager
) -> None:
    pool = manager.block_pool
    manager.allocate_new_blocks("r", 24)  # blocks 1..6
    manager.remove_skipped_blocks("r", 17)
    num_skipped_blocks = manager.get_num_skipped_tokens(17) // BLOCK_SIZE
    expected = {"full": 0, "sliding_window": 2, "chunked_local": 3}.get(kind, 0)
    assert num_skipped_blocks == expected
    table = manager.req_to_blocks["r"]
    assert ids(table) == [0] * expected + list(range(expected + 1, 7))
    # The later (longer-prefix) block is freed first, so it is reused first.
    assert pool.free_block_ids()[:expected] == list(range(expected, 0, -1))
    manager.remove_skipped_blocks("r", 17)  # idempotent
    assert pool.get_num_free_blocks() == NUM_BLOCKS - 1 - (6 - expected)
    check(manager)


def test_check_invariants_detects_a_bad_ref_count(manager: SingleTypeKVCacheManager) -> None:
    manager.allocate_new_blocks("r", 5)
    check(manager)
    manager.req_to_blocks["r"][0].ref_cnt = 0
    with pytest.raises(InvariantViolation, match="ref_cnt 0"):
        manager.check_invariants()


def test_check_invariants_detects_a_foreign_block(manager: SingleTypeKVCacheManager) -> None:
    other_pool = BlockPool(NUM_BLOCKS, hash_block_size=BLOCK_SIZE)
    manager.req_to_blocks["r"] = other_pool.get_new_blocks(1)
    with pytest.raises(InvariantViolation, match="foreign block"):
        manager.check_invariants()
