"""Sliding-window manager: right-to-left hit search, leading-run fallback, windows smaller and
larger than a block, early frees on the processed-token basis, the admission cap."""

from __future__ import annotations

import pytest

from pagedkv import BlockPool, ConfigError, SlidingWindowSpec
from pagedkv.managers import SlidingWindowManager
from tests.support.hybrid import admit, full, ids, make_manager, make_request, swa


def hit_ids(manager, request) -> tuple[list[int], int]:
    blocks, num_tokens, _ = manager.get_computed_blocks(request)
    return blocks.get_block_ids()[0], num_tokens


def test_skipped_tokens_are_those_before_the_next_tokens_window() -> None:
    pool = BlockPool(8, hash_block_size=4)
    manager = SlidingWindowManager(swa(4, 4), pool, 0)
    # The reference's docstring example: window 4, 7 computed tokens -> 4 skipped.
    assert [manager.get_num_skipped_tokens(n) for n in (0, 3, 4, 7, 20)] == [0, 0, 1, 4, 17]


def test_window_smaller_than_a_block() -> None:
    # Window 4 in blocks of 16: a hit needs just one cached block (the 3 tokens before).
    manager = make_manager(12, swa(16, 4))
    prompt = list(range(50))
    first = make_request("a", prompt, 16)
    assert admit(manager, first)[1].get_block_ids() == ([1, 2, 3, 4],)
    manager.free(first)
    # Unhashed block 4 went to the head; the hashed ones to the tail, last first.
    assert manager.block_pool.free_block_ids()[:1] == [4]
    assert manager.block_pool.free_block_ids()[-3:] == [3, 2, 1]

    second = make_request("b", prompt, 16)
    assert hit_ids(manager, second) == ([0, 0, 3], 48)
    num_hit, new_blocks = admit(manager, second)
    assert num_hit == 48 and new_blocks.get_block_ids() == ([4],)
    assert manager.get_block_ids("b") == ([0, 0, 3, 4],)
    manager.check_invariants()
    manager.free(second)

    manager.evict_blocks({3})
    assert hit_ids(manager, make_request("c", prompt, 16)) == ([0, 2], 32)


def test_window_larger_than_a_block_and_the_leading_run() -> None:
    # Window 10 in blocks of 4: a hit must end with cdiv(9, 4) = 3 cached blocks.
    manager = make_manager(20, swa(4, 10))
    prompt = list(range(30))
    first = make_request("a", prompt, 4)
    assert admit(manager, first)[1].get_block_ids() == ([1, 2, 3, 4, 5, 6, 7, 8],)
    manager.free(first)

    assert hit_ids(manager, make_request("b", prompt, 4)) == ([0, 0, 0, 0, 5, 6, 7], 28)
    # Losing position 5 rules out every window covering it: the next candidate ends at 5.
    manager.evict_blocks({6})
    assert hit_ids(manager, make_request("c", prompt, 4)) == ([0, 0, 3, 4, 5], 20)
    # Losing position 2 too leaves no 3-block window; the cached run from block 0 is the hit.
    manager.evict_blocks({3})
    assert hit_ids(manager, make_request("d", prompt, 4)) == ([1, 2], 8)
    manager.evict_blocks({1})
    assert hit_ids(manager, make_request("e", prompt, 4)) == ([], 0)
    manager.check_invariants()


def test_rightmost_window_wins_over_an_earlier_one() -> None:
    manager = make_manager(20, swa(4, 8))  # a hit needs 2 cached blocks
    prompt = list(range(33))
    first = make_request("a", prompt, 4)
    admit(manager, first)
    manager.free(first)
    # Cached positions 0..7 are blocks 1..8. Drop position 5: windows [6, 8) and [0..5) remain.
    manager.evict_blocks({6})
    assert hit_ids(manager, make_request("b", prompt, 4)) == ([0, 0, 0, 0, 0, 0, 7, 8], 32)


def test_search_respects_the_alignment() -> None:
    """With an alignment of 2 blocks, only windows ending on an even block count."""
    pool = BlockPool(16, hash_block_size=4)
    spec = swa(4, 8)  # need 2
    manager = SlidingWindowManager(spec, pool, 0, alignment_tokens=8)
    request = make_request("a", range(22), 4)
    manager.allocate_new_blocks("a", 22)  # blocks 1..6
    manager.cache_blocks(request, 20)  # positions 0..4 cached

    def search(max_length: int) -> tuple[list[int], int]:
        blocks, num_tokens = SlidingWindowManager.find_longest_cache_hit(
            request.block_hashes, max_length, (0,), pool, spec, 8
        )
        return ids(blocks[0]), num_tokens

    # Unaligned, the window [3, 5) would give 20 tokens; aligned the best end is 4.
    assert search(21) == ([0, 0, 3, 4], 16)
    pool.evict_blocks({4})
    assert search(21) == ([1, 2], 8)
    # A leading run of one block is cut to the alignment: no hit.
    pool.evict_blocks({2})
    assert search(21) == ([], 0)


def test_blocks_leave_the_window_on_the_processed_basis() -> None:
    manager = make_manager(20, swa(4, 8))
    request = make_request("a", range(30), 4)
    admit(manager, request)  # 30 tokens computed, blocks 1..8, 1..7 cached
    request.append_output_token_ids(7)
    request.num_in_flight_tokens = 4  # the last 4 computed tokens are not processed yet
    assert manager.allocate_slots(request, 1) is not None
    # Processed 26 tokens: 26 - 8 + 1 = 19 skipped -> 4 blocks freed (cached: to the tail,
    # the longer prefix first so it is evicted first).
    assert manager.get_block_ids("a") == ([0, 0, 0, 0, 5, 6, 7, 8],)
    assert manager.block_pool.free_block_ids()[-4:] == [4, 3, 2, 1]
    request.num_computed_tokens += 1
    request.num_in_flight_tokens = 0
    request.append_output_token_ids(7)
    manager.allocate_slots(request, 1)
    # Processed 31: 24 skipped -> positions 4 and 5 go too.
    assert manager.get_block_ids("a") == ([0, 0, 0, 0, 0, 0, 7, 8],)
    manager.check_invariants()


def test_admission_cap_limits_the_full_sequence_check() -> None:
    # cap = cdiv(min(7 + 16, 1024), 4) + 1 = 7 blocks, although the prompt spans 50.
    spec = swa(4, 8)
    assert spec.max_admission_blocks(1024, 16) == 7
    fits = make_manager(8, spec, max_model_len=1024, max_in_flight_tokens=16)  # 7 usable
    request = make_request("a", range(200), 4)
    new_blocks = fits.allocate_slots(request, 16, full_sequence_must_fit=True)
    assert new_blocks is not None and new_blocks.get_block_ids() == ([1, 2, 3, 4],)
    short = make_manager(7, spec, max_model_len=1024, max_in_flight_tokens=16)  # 6 usable
    assert short.allocate_slots(request, 16, full_sequence_must_fit=True) is None
    assert short.block_pool.get_num_free_blocks() == 6
    # Full attention has no cap: the same check wants all 50 blocks.
    uncapped = make_manager(8, full(4), max_model_len=1024, max_in_flight_tokens=16)
    assert uncapped.allocate_slots(request, 16, full_sequence_must_fit=True) is None


def test_extra_retained_tokens_delay_the_frees_and_raise_the_cap() -> None:
    retained = SlidingWindowSpec(4, 1, 8, 2, sliding_window=8, extra_retained_tokens=5)
    pool = BlockPool(8, hash_block_size=4)
    manager = SlidingWindowManager(retained, pool, 0)
    plain = SlidingWindowManager(swa(4, 8), pool, 0)
    assert [manager.get_num_skipped_tokens(n) for n in (0, 12, 13, 29)] == [0, 0, 1, 17]
    assert [plain.get_num_skipped_tokens(n) for n in (0, 12, 13, 29)] == [0, 5, 6, 22]
    # Admission holds the window, the retained tokens and the in-flight ones, +1 for alignment.
    assert (
        retained.max_admission_blocks(8192, 16) == 8
        and swa(4, 8).max_admission_blocks(8192, 16) == 7
    )
    with pytest.raises(ConfigError, match="extra_retained_tokens must be an int >= 0, got -1"):
        SlidingWindowSpec(4, 1, 8, 2, sliding_window=8, extra_retained_tokens=-1)
