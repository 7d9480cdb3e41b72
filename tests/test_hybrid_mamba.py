"""Mamba: the rightmost aligned cached state wins, only the latest state block is held, and a
state cached in the current step cannot serve another request until `new_step_starts`."""

from __future__ import annotations

import pytest
from hybrid_support import admit, full, make_manager, make_request, mamba

from pagedkv import InvariantViolation
from pagedkv.coordinators.hybrid import HybridKVCacheCoordinator


def hit_ids(manager, request) -> tuple[tuple[list[int], ...], int]:
    blocks, num_tokens, _ = manager.get_computed_blocks(request)
    return blocks.get_block_ids(), num_tokens


def decode(manager, request, token: int) -> None:
    request.append_output_token_ids(token)
    assert manager.allocate_slots(request, 1) is not None
    request.num_computed_tokens += 1


def test_state_cached_this_step_is_a_miss_until_the_next_step() -> None:
    manager = make_manager(12, mamba(4))
    prompt = list(range(10))
    first = make_request("a", prompt, 4)
    assert admit(manager, first)[1].get_block_ids() == ([1, 2, 3],)
    # Blocks 1 and 2 were cached in this step: their states are not written yet.
    assert hit_ids(manager, make_request("b", prompt, 4)) == (([],), 0)
    manager.new_step_starts()
    second = make_request("b", prompt, 4)
    assert hit_ids(manager, second) == (([0, 2],), 8)
    num_hit, new_blocks = admit(manager, second)
    assert num_hit == 8 and new_blocks.get_block_ids() == ([4],)
    assert manager.get_block_ids("b") == ([0, 2, 4],)
    manager.check_invariants()


def test_only_the_latest_state_block_is_held() -> None:
    manager = make_manager(12, mamba(4))
    request = make_request("a", range(10), 4)
    admit(manager, request)  # blocks 1, 2, 3; positions 0 and 1 cached
    decode(manager, request, 10)
    # 10 tokens processed: the state after token 10 lives in position 2; 0 and 1 are freed
    # (still cached, the longer prefix first, so it is evicted first).
    assert manager.get_block_ids("a") == ([0, 0, 3],)
    assert manager.block_pool.free_block_ids()[-2:] == [2, 1]
    decode(manager, request, 11)
    decode(manager, request, 12)  # 12 tokens: the table grows to position 3
    assert manager.get_block_ids("a") == ([0, 0, 3, 4],)
    decode(manager, request, 13)
    assert manager.get_block_ids("a") == ([0, 0, 0, 4],)
    manager.check_invariants()


def test_older_state_serves_while_a_newer_one_is_fresh() -> None:
    manager = make_manager(16, mamba(4))
    admit(manager, make_request("a", range(10), 4))  # caches positions 0, 1 (blocks 1, 2)
    manager.new_step_starts()
    longer = list(range(16))
    num_hit, new_blocks = admit(manager, make_request("c", longer, 4))
    assert num_hit == 8 and new_blocks.get_block_ids() == ([4, 5],)  # positions 2, 3 cached now
    # Position 2's state (block 4) is from this step; position 1's (block 2) is older.
    assert hit_ids(manager, make_request("d", longer, 4)) == (([0, 2],), 8)
    manager.new_step_starts()
    assert hit_ids(manager, make_request("d", longer, 4)) == (([0, 0, 4],), 12)


def test_full_attention_plus_mamba() -> None:
    manager = make_manager(20, full(16), mamba(16))
    common = [i for i in range(3) for _ in range(16)]
    first = make_request("a", common + [3] * 7, 16)
    assert admit(manager, first)[1].get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8])
    second = make_request("b", common + [4] * 5, 16)
    # Same step: full attention would hit 48 tokens, Mamba's states are not written yet.
    assert hit_ids(manager, second) == (([], []), 0)
    manager.new_step_starts()
    assert hit_ids(manager, second) == (([1, 2, 3], [0, 0, 7]), 48)
    num_hit, new_blocks = admit(manager, second)
    assert num_hit == 48 and new_blocks.get_block_ids() == ([9], [10])
    assert manager.block_pool.blocks[7].ref_cnt == 2
    manager.check_invariants()


def test_mamba_groups_of_one_bucket_share_the_same_step_record() -> None:
    manager = make_manager(40, full(16), mamba(16), mamba(16))
    coordinator = manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [b.group_ids for b in coordinator.spec_buckets] == [(0,), (1, 2)]
    managers = coordinator.single_type_managers
    assert managers[1].block_ids_cached_this_step is managers[2].block_ids_cached_this_step
    prompt = list(range(55))
    first = make_request("a", prompt, 16)
    assert admit(manager, first)[1].get_block_ids() == (
        [1, 2, 3, 4],
        [5, 6, 7, 8],
        [9, 10, 11, 12],
    )
    manager.free(first)
    manager.new_step_starts()
    # Group 2 loses position 2; a second request re-caches it there (this step), while group 1
    # keeps the first request's older block as the one lookups return.
    manager.evict_blocks({11})
    second = make_request("b", prompt, 16)
    assert admit(manager, second)[0] == 32
    assert manager.get_block_ids("b") == ([1, 2, 12, 8], [0, 6, 4, 13], [0, 10, 14, 15])
    assert manager.block_pool.cached_hashes(1)[second.block_hashes[2]] == [7, 4]
    assert manager.block_pool.cached_hashes(2)[second.block_hashes[2]] == [14]
    # Group 2's state at 48 is from this step, so the bucket misses there.
    assert hit_ids(manager, make_request("c", prompt, 16)) == (([1, 2], [0, 6], [0, 10]), 32)
    manager.new_step_starts()
    assert hit_ids(manager, make_request("c", prompt, 16)) == (
        ([1, 2, 3], [0, 0, 7], [0, 0, 14]),
        48,
    )
    manager.check_invariants()
    managers[2].block_ids_cached_this_step = set()
    with pytest.raises(InvariantViolation, match="Mamba group 2 keeps its own step record"):
        manager.check_invariants()


def test_caching_off_with_one_block_per_request() -> None:
    manager = make_manager(4, mamba(64), max_model_len=64, enable_caching=False)
    request = make_request("a", range(40), 64)
    assert manager.allocate_slots(request, 40).get_block_ids() == ([1],)
    request.num_computed_tokens = 40
    for token in range(20):
        decode(manager, request, token)
    assert manager.get_block_ids("a") == ([1],)
    manager.check_invariants()
