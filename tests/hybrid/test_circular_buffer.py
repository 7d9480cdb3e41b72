"""Circular-buffer scratch groups (vLLM 0.33's `CircularBufferSpec`, a compressor's ring): one
block per request from its first allocation to its free, whatever its length; never cached,
never a hit; its block size (the ring's capacity) stays out of the block-size lattice."""

from __future__ import annotations

from pagedkv import CircularBufferSpec
from pagedkv.managers import CircularBufferManager
from tests.support.hybrid import admit, full, make_manager, make_request


def ring(capacity: int) -> CircularBufferSpec:
    return CircularBufferSpec(capacity, 1, 8, 2)


def test_one_ring_block_per_request_for_its_whole_life() -> None:
    # A 6-row ring beside 4-token blocks: 6 divides no lattice, and none is needed.
    manager = make_manager(12, full(4), ring(6), enable_kv_cache_events=True)
    assert manager.coordinator.scheduler_block_size == 4
    assert isinstance(manager.coordinator.single_type_managers[1], CircularBufferManager)
    first = make_request("a", range(18), 4)
    assert admit(manager, first)[1].get_block_ids() == ([1, 2, 3, 4, 5], [6])
    new_ids = []
    for token in range(100, 103):
        first.append_output_token_ids(token)
        new_ids.append(manager.allocate_slots(first, 1).get_block_ids())
        first.num_computed_tokens += 1
    assert new_ids == [([], []), ([], []), ([7], [])]  # the ring never grows
    assert manager.get_block_ids("a") == ([1, 2, 3, 4, 5, 7], [6])
    # Only the paged group publishes: the prompt's 4 blocks, then the fifth once full.
    assert [(e.group_idx, len(e.block_hashes)) for e in manager.take_events()] == [(0, 4), (0, 1)]
    manager.free(first)
    manager.check_invariants()
    assert manager.block_pool.free_block_ids() == [6, 7, 8, 9, 10, 11, 5, 4, 3, 2, 1]

    second = make_request("b", range(18), 4)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(second)
    assert hits.get_block_ids() == ([1, 2, 3, 4], []) and num_hit_tokens == 16
    assert admit(manager, second)[1].get_block_ids() == ([6], [7])
    assert manager.get_block_ids("b") == ([1, 2, 3, 4, 6], [7])
    manager.check_invariants()


def test_the_ring_block_is_counted_before_anything_is_taken() -> None:
    # 5 usable blocks: 18 tokens need 5 paged blocks and the ring 1, so nothing is allocated.
    manager = make_manager(6, full(4), ring(6), max_model_len=20)
    request = make_request("a", range(18), 4)
    free_before = manager.block_pool.free_block_ids()
    assert manager.allocate_slots(request, 18) is None
    assert manager.block_pool.free_block_ids() == free_before
    assert manager.get_block_ids("a") == ([], [])
    smaller = make_request("b", range(16), 4)
    assert manager.allocate_slots(smaller, 16).get_block_ids() == ([1, 2, 3, 4], [5])
    manager.check_invariants()
