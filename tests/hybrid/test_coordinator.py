"""Hybrid coordinator: the longest hit valid in every group (buckets, fixed point, LCM alignment),
LCM-rounded caching, two-phase adoption, configuration errors and event annotation."""

from __future__ import annotations

import pytest

from pagedkv import BlockStored, ConfigError
from pagedkv.coordinators import UnitaryKVCacheCoordinator
from pagedkv.coordinators.hybrid import HybridKVCacheCoordinator
from pagedkv.managers import FullAttentionManager, SlidingWindowManager
from tests.support.hybrid import admit, chunked, full, make_manager, make_request, mamba, swa


def hit_ids(manager, request) -> tuple[tuple[list[int], ...], int]:
    blocks, num_tokens, _ = manager.get_computed_blocks(request)
    return blocks.get_block_ids(), num_tokens


def cached_ids(manager, group_id: int) -> list[int]:
    return sorted(b for ids in manager.block_pool.cached_hashes(group_id).values() for b in ids)


# ---------------------------------------------------------------- full + two sliding windows

COMMON = [i for i in range(3) for _ in range(16)]  # three full blocks of 16


def full_and_two_windows():
    """Two requests with a 48-token common prefix, both finished (blocks free but cached)."""
    manager = make_manager(21, full(16), swa(16, 32), swa(16, 32))
    first = make_request("0", COMMON + [3] * 7, 16)
    num_hit, new_blocks = admit(manager, first)
    assert num_hit == 0
    assert new_blocks.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12])
    second = make_request("1", COMMON + [3] * 5, 16)
    assert hit_ids(manager, second) == (([1, 2, 3], [0, 6, 7], [0, 10, 11]), 48)
    num_hit, new_blocks = admit(manager, second)
    assert num_hit == 48 and new_blocks.get_block_ids() == ([13], [14], [15])
    for block_id in (1, 2, 3, 6, 7, 10, 11):
        assert manager.block_pool.blocks[block_id].ref_cnt == 2
    manager.check_invariants()
    manager.free(first)
    manager.free(second)
    return manager


@pytest.mark.parametrize(
    ("evicted", "expected"),
    [
        # Blocks outside the window are not needed: the hit is unchanged.
        ({5, 9}, (([1, 2, 3], [0, 6, 7], [0, 10, 11]), 48)),
        # Full attention's first block gone: nothing hits.
        ({1}, (([], [], []), 0)),
        # The last block of every group, or of any one group, gone: two blocks hit.
        ({3, 7, 11}, (([1, 2], [5, 6], [9, 10]), 32)),
        ({3}, (([1, 2], [5, 6], [9, 10]), 32)),
        ({7}, (([1, 2], [5, 6], [9, 10]), 32)),
        ({11}, (([1, 2], [5, 6], [9, 10]), 32)),
        # Full attention hits 2 blocks, the windows only at 3: no common length.
        ({3, 5, 9}, (([], [], []), 0)),
    ],
)
def test_hit_matrix_when_groups_lose_blocks(evicted, expected) -> None:
    manager = full_and_two_windows()
    manager.evict_blocks(evicted)
    assert hit_ids(manager, make_request("2", COMMON + [3] * 7, 16)) == expected


def test_full_plus_one_bucket_needs_one_lookup_each(monkeypatch) -> None:
    manager = full_and_two_windows()
    manager.evict_blocks({7})  # the windows fall back to 32 tokens
    calls: list[tuple[str, int]] = []
    for name, klass in (("full", FullAttentionManager), ("window", SlidingWindowManager)):
        search = klass.find_longest_cache_hit

        def spy(cls, block_hashes, max_length, *args, name=name, search=search):
            calls.append((name, max_length))
            return search(block_hashes, max_length, *args)

        monkeypatch.setattr(klass, "find_longest_cache_hit", classmethod(spy))
    assert hit_ids(manager, make_request("2", COMMON + [3] * 7, 16))[1] == 32
    # Full attention answers 48; the windows shrink it to 32, which full attention's longer
    # hit covers without a second lookup.
    assert calls == [("full", 54), ("window", 48)]


def test_identical_specs_share_a_bucket_and_full_attention_comes_first() -> None:
    manager = make_manager(8, swa(16, 32), full(16), swa(16, 32), swa(16, 64))
    coordinator = manager.coordinator
    assert isinstance(coordinator, HybridKVCacheCoordinator)
    assert [b.group_ids for b in coordinator.spec_buckets] == [(1,), (0, 2), (3,)]
    assert [b.is_full_attention for b in coordinator.spec_buckets] == [True, False, False]


# ---------------------------------------------------------------- different block sizes


def test_different_block_sizes_align_to_their_lcm() -> None:
    # Full attention in blocks of 32, a 32-token window in blocks of 16; hashes every 16.
    manager = make_manager(40, full(32), swa(16, 32), hash_block_size=16)
    assert manager.coordinator.scheduler_block_size == 32
    prompt = list(range(113))
    first = make_request("a", prompt, 16)
    new_blocks = manager.allocate_slots(first, 112)  # 7 blocks of 16 computed
    assert new_blocks.get_block_ids() == ([1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11])
    # Caching stops at 96, the last multiple of 32: 3 full blocks, 6 window blocks.
    assert (cached_ids(manager, 0), cached_ids(manager, 1)) == ([1, 2, 3], [5, 6, 7, 8, 9, 10])
    # A 32-token block is keyed by the 16-token chain hash at its end.
    blocks = manager.block_pool.blocks
    assert [blocks[i].block_hash for i in (1, 2, 3)] == first.block_hashes[1:6:2]
    assert [blocks[i].block_hash for i in range(5, 11)] == first.block_hashes[:6]
    manager.free(first)
    second = make_request("b", prompt, 16)
    assert hit_ids(manager, second) == (([1, 2, 3], [0, 0, 0, 0, 9, 10]), 96)
    # Without window positions 5 and 6 the window alone could hit 80 tokens ([7, 8] end at 5
    # blocks), but 80 is not a multiple of 32: full 2 blocks, window 4 blocks.
    manager.evict_blocks({10, 11})
    assert hit_ids(manager, second) == (([1, 2], [0, 0, 7, 8]), 64)
    num_hit, new_blocks = admit(manager, second)
    # The first request's unhashed last blocks were freed to the head (group 1's last of all).
    assert num_hit == 64 and new_blocks.get_block_ids() == ([11, 4], [12, 13, 14, 15])
    manager.check_invariants()


def test_cached_tokens_round_down_to_the_lcm() -> None:
    manager = make_manager(20, full(16), swa(32, 64), hash_block_size=16)
    request = make_request("a", range(50), 16)
    assert admit(manager, request)[1].get_block_ids() == ([1, 2, 3, 4], [5, 6])
    # 50 tokens: three full blocks of 16, but only 32 tokens are a whole number of 32s.
    assert (cached_ids(manager, 0), cached_ids(manager, 1)) == ([1, 2], [5])
    request.append_output_token_ids(list(range(14)))
    manager.allocate_slots(request, 14)
    assert (cached_ids(manager, 0), cached_ids(manager, 1)) == ([1, 2, 3, 4], [5, 6])
    manager.check_invariants()


def test_block_size_not_a_multiple_of_the_hash_block_size() -> None:
    with pytest.raises(ConfigError, match="group 1's block size 24 is not a multiple of"):
        make_manager(20, full(16), swa(24, 48), hash_block_size=16)


def test_full_attention_plus_chunked_local() -> None:
    manager = make_manager(40, full(4), chunked(4, 8))
    prompt = list(range(30))
    first = make_request("a", prompt, 4)
    # Full attention has nothing cached, so the chunk's free "hit" of 24 tokens does not count.
    num_hit, new_blocks = admit(manager, first)
    assert num_hit == 0
    assert new_blocks.get_block_ids() == (list(range(1, 9)), list(range(9, 17)))
    manager.free(first)
    second = make_request("b", prompt, 4)
    assert hit_ids(manager, second) == ((list(range(1, 8)), [0] * 6 + [15]), 28)
    # A block of an earlier chunk does not matter; one of the current chunk does.
    manager.evict_blocks({14})
    assert hit_ids(manager, second) == ((list(range(1, 8)), [0] * 6 + [15]), 28)
    manager.evict_blocks({15})
    assert hit_ids(manager, second) == ((list(range(1, 7)), [0] * 6), 24)
    num_hit, new_blocks = admit(manager, second)
    # The unhashed last blocks of the first request's tables are reused first.
    assert num_hit == 24 and new_blocks.get_block_ids() == ([16, 8], [17, 18])
    assert manager.get_block_ids("b") == (
        [1, 2, 3, 4, 5, 6, 16, 8],
        [0, 0, 0, 0, 0, 0, 17, 18],
    )
    manager.check_invariants()


# ---------------------------------------------------------------- the fixed point


def seed(manager, request, num_tokens: int, chunk: int = 4) -> list:
    """Prefill a request `chunk` tokens a step, as vLLM's scheduler splits for Mamba "align"
    (so every block boundary's state is cached); returns each step's new block ids."""
    new_ids = []
    while request.num_computed_tokens < num_tokens:
        num_new = min(chunk, num_tokens - request.num_computed_tokens)
        new_ids.append(manager.allocate_slots(request, num_new).get_block_ids())
        request.num_computed_tokens += num_new
        manager.new_step_starts()
    return new_ids


def test_fixed_point_over_two_non_full_buckets() -> None:
    """Window and Mamba shrink each other's candidate twice before agreeing on 8 tokens.

    Expected values: vLLM 0.33's own manager, same calls."""
    manager = make_manager(40, swa(4, 8), mamba(4))
    prompt = list(range(30))
    first = make_request("a", prompt, 4)
    assert seed(manager, first, 28) == [([2 * i + 1], [2 * i + 2]) for i in range(7)]
    assert manager.get_block_ids("a") == ([0, 0, 0, 0, 9, 11, 13], [0, 0, 0, 0, 0, 12, 14])
    manager.free(first)
    second = make_request("b", prompt, 4)
    assert hit_ids(manager, second) == (([0, 0, 0, 0, 0, 11, 13], [0] * 6 + [14]), 28)
    manager.evict_blocks({5, 2, 6, 10, 12, 14})  # window position 2; Mamba 0, 2, 4, 5, 6
    # Window at 29 -> 28; Mamba at 28 -> 16 (position 3); window at 16 -> 8 (the window
    # [2, 4) misses, [0, 2) hits); Mamba at 8 -> 8 (position 1): both agree.
    assert hit_ids(manager, second) == (([1, 3], [0, 4]), 8)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(second)
    new_blocks = manager.allocate_slots(second, 22, num_hit_tokens, hits)
    assert new_blocks.get_block_ids() == ([15, 16, 17, 18, 19, 20], [0, 0, 0, 0, 0, 21])
    manager.check_invariants()


# ---------------------------------------------------------------- adoption


def test_all_groups_touch_their_hits_before_any_group_allocates(monkeypatch) -> None:
    manager = make_manager(40, full(4), swa(4, 8), mamba(4))
    prompt = list(range(17))
    first = make_request("a", prompt, 4)
    seed(manager, first, 16)
    first.append_output_token_ids(99)
    assert manager.allocate_slots(first, 1).get_block_ids() == ([13], [14], [15])
    first.num_computed_tokens = 17
    manager.free(first)
    manager.new_step_starts()
    pool = manager.block_pool
    calls: list[str] = []
    touch, get_new_blocks = pool.touch, pool.get_new_blocks

    def recording_touch(blocks):
        calls.append("touch")
        return touch(blocks)

    def recording_get_new_blocks(num_blocks):
        calls.append("new")
        return get_new_blocks(num_blocks)

    monkeypatch.setattr(pool, "touch", recording_touch)
    monkeypatch.setattr(pool, "get_new_blocks", recording_get_new_blocks)
    second = make_request("b", prompt, 4)
    num_hit, new_blocks = admit(manager, second)
    assert num_hit == 16 and new_blocks.get_block_ids() == ([15], [14], [13])
    assert calls == ["touch", "touch", "touch", "new", "new", "new"]
    assert manager.get_block_ids("b") == (
        [1, 4, 7, 10, 15],
        [0, 0, 8, 11, 14],
        [0, 0, 0, 12, 13],
    )
    manager.check_invariants()


# ---------------------------------------------------------------- facade-level behaviour


def test_take_events_annotates_kind_and_window_per_group() -> None:
    manager = make_manager(20, full(4), swa(4, 8), enable_kv_cache_events=True)
    request = make_request("a", range(9), 4)
    admit(manager, request)
    events = manager.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockStored]
    for group_id, event in enumerate(events):
        assert event.group_idx == group_id
        assert event.block_hashes == request.block_hashes[:2]
        assert event.parent_block_hash is None
        assert event.token_ids == list(range(8))
        assert event.block_size == 4
    assert (events[0].kv_cache_spec_kind, events[0].kv_cache_spec_sliding_window) == (
        "full_attention",
        None,
    )
    assert (events[1].kv_cache_spec_kind, events[1].kv_cache_spec_sliding_window) == (
        "sliding_window",
        8,
    )
    assert manager.take_events() == []


def test_single_group_builds_the_unitary_coordinator() -> None:
    assert isinstance(make_manager(8, full(16)).coordinator, UnitaryKVCacheCoordinator)
