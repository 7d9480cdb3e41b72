"""`KVCacheManager.try_prefill_and_free`: a prompt replayed by its block hashes alone.

Its contract is equivalence: block for block the same as `get_computed_blocks`,
`allocate_slots(..., has_scheduled_reqs=False)` and `free` of a request with those hashes.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import (
    ConfigError,
    FullAttentionSpec,
    InvalidArgumentError,
    InvalidTypeError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    SlidingWindowSpec,
)
from tests.support.builders import admit, free_ids, make_manager, make_request, snapshot

BLOCK_SIZE = 4
PREFIXES = [[], [1] * 8, [1] * 8 + [2] * 4, list(range(10, 22)), [3] * 16]


def test_reference_prefill_sequence(manager):
    # The reference's test_prefill through the new call: same hits, same free order.
    common = [i for i in range(3) for _ in range(16)]
    first = make_request("0", common + [3] * 7)
    assert manager.try_prefill_and_free(first.block_hashes, first.num_tokens) == 0
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    second = make_request("1", common + [3] * 5)
    assert manager.try_prefill_and_free(second.block_hashes, second.num_tokens) == 48
    # The second prompt's partial block (4, reused from the head) goes back to the head.
    assert free_ids(manager) == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    manager.check_invariants()


def prompts_strategy():
    prompt = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 5), max_size=14))
    held = st.booleans()  # whether the prompt stays allocated (a running request)
    return st.lists(st.tuples(prompt, held), min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(
    prompts=prompts_strategy(),
    num_blocks=st.integers(3, 16),
    caching=st.booleans(),
    watermark=st.sampled_from([0.0, 0.3]),
)
def test_equals_the_request_calls(prompts, num_blocks, caching, watermark):
    kwargs = {"enable_caching": caching, "watermark": watermark}
    by_requests = make_manager(num_blocks, BLOCK_SIZE, max_model_len=64, **kwargs)
    by_hashes = make_manager(num_blocks, BLOCK_SIZE, max_model_len=64, **kwargs)
    ids = itertools.count()
    for (prefix, suffix), held in prompts:
        tokens = prefix + suffix or [7]
        if held:
            # A running request in both managers: its blocks are shared, not evictable.
            for manager in (by_requests, by_hashes):
                admit(manager, make_request(f"held{next(ids)}", tokens, BLOCK_SIZE))
            continue
        request = make_request(f"r{next(ids)}", tokens, BLOCK_SIZE)
        hit = by_requests.get_computed_blocks(request)
        allocated = by_requests.allocate_slots(
            request,
            request.num_tokens - hit.num_computed_tokens,
            hit.num_computed_tokens,
            hit.blocks,
            has_scheduled_reqs=False,
        )
        if allocated is not None:
            by_requests.free(request)
        expected = None if allocated is None else hit.num_computed_tokens
        result = by_hashes.try_prefill_and_free(request.block_hashes, request.num_tokens)
        assert result == expected
        assert free_ids(by_hashes) == free_ids(by_requests)
        assert by_hashes.block_pool.cached_hashes() == by_requests.block_pool.cached_hashes()
        by_hashes.check_invariants()


def test_a_prompt_that_does_not_fit_changes_nothing():
    manager = make_manager(5, BLOCK_SIZE, max_model_len=64)
    admit(manager, make_request("held", [1] * 8, BLOCK_SIZE))  # 2 of 4 blocks held
    big = make_request("big", [1] * 8 + [2] * 9, BLOCK_SIZE)  # 2 hits + 3 new blocks
    before = snapshot(manager)
    assert manager.try_prefill_and_free(big.block_hashes, big.num_tokens) is None
    assert snapshot(manager) == before


def test_keys_are_only_compared():
    # Any hashable keys equal iff the prefixes are equal work, e.g. ints.
    manager = make_manager(8, BLOCK_SIZE, max_model_len=64)
    assert manager.try_prefill_and_free([101, 102, 103], 13) == 0
    assert manager.try_prefill_and_free([101, 102, 104], 12) == 8
    assert manager.try_prefill_and_free([101, 102, 104], 13) == 12
    manager.check_invariants()


def test_bad_arguments_change_nothing():
    manager = make_manager(8, BLOCK_SIZE, max_model_len=16)
    request = make_request("a", list(range(10)), BLOCK_SIZE)
    before = snapshot(manager)
    with pytest.raises(InvalidArgumentError, match="max_model_len 16"):
        manager.try_prefill_and_free(request.block_hashes * 3, 17)
    with pytest.raises(InvalidArgumentError, match="2 full blocks but 1 block hashes"):
        manager.try_prefill_and_free(request.block_hashes[:1], 10)
    with pytest.raises(InvalidArgumentError, match="num_tokens must be >= 1"):
        manager.try_prefill_and_free([], 0)
    with pytest.raises(InvalidTypeError, match="num_tokens must be an int"):
        manager.try_prefill_and_free(request.block_hashes, True)
    assert snapshot(manager) == before


def test_needs_one_full_attention_group_and_no_events():
    with_events = make_manager(8, BLOCK_SIZE, enable_kv_cache_events=True)
    with pytest.raises(ConfigError, match="KV events off"):
        with_events.try_prefill_and_free([1, 2], 8)
    full = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=1)
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=1, dtype_bytes=1, sliding_window=8
    )
    groups = (KVCacheGroupSpec(("full",), full), KVCacheGroupSpec(("window",), window))
    hybrid = KVCacheManager(KVCacheConfig(16, groups), 64)
    with pytest.raises(ConfigError, match="one full-attention KV-cache group"):
        hybrid.try_prefill_and_free([1, 2], 8)
