"""Sliding-window sparse retention and the EAGLE drop, as vLLM 0.33 does them.

Full attention at 16 tokens a block and a 4-token window at 4 tokens a block: hits land on
16-token boundaries, where a window hit needs only the one block before the boundary (two with
EAGLE, which peeks one block past it). vLLM 0.33 hashes only those blocks (`reachable_block_mask`)
unless the interval says otherwise, so the stored events, the free-queue order after a free and
the hits are different from caching every block. Every expected value below was produced by
running the same calls on vLLM 0.33's own KVCacheManager, the prompt-tail sub-block entry of the
full-attention group included (the hash boundary at 68 tokens, inside its fifth block: entered
by the prefill with EAGLE, whose groups cache the whole prompt, else by the decode step that
reaches 80 tokens).
"""

from __future__ import annotations

import pytest

from pagedkv import (
    BlockStored,
    ConfigError,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
)
from tests.support.hybrid import full, make_request, swa


def make_manager(retention: int | None, use_eagle: bool) -> KVCacheManager:
    groups = [KVCacheGroupSpec(("full",), full(16)), KVCacheGroupSpec(("window",), swa(4, 4))]
    return KVCacheManager(
        KVCacheConfig(40, groups, prefix_cache_retention_interval=retention),
        max_model_len=8192,
        enable_kv_cache_events=True,
        use_eagle=use_eagle,
    )


def run(retention: int | None, use_eagle: bool, set_after: bool = False):
    """Prefill 70 tokens at once, decode 12, free; return the manager, request and events.
    `set_after`: build without an interval and set `retention` on the coordinator."""
    manager = make_manager(None if set_after else retention, use_eagle)
    if set_after:
        # No interval and no EAGLE: the running requests' fast path.
        assert (manager._running_allocator is not None) == (not use_eagle)  # noqa: SLF001
        manager.set_retention_interval(retention)
        # Replay boundaries (an interval) are the general path's: the fast path is re-picked.
        assert manager._running_allocator is None  # noqa: SLF001
    request = make_request("a", range(70), 4)
    assert manager.allocate_slots(request, 70).get_block_ids() == (
        [1, 2, 3, 4, 5],
        list(range(6, 24)),
    )
    prefill_events = manager.take_events()
    request.num_computed_tokens = 70
    for token in range(1000, 1012):
        request.append_output_token_ids(token)
        manager.allocate_slots(request, 1)
        request.num_computed_tokens += 1
    decode_events = manager.take_events()
    manager.free(request)
    manager.check_invariants()
    return manager, request, prefill_events, decode_events


# retention, eagle -> window positions hashed by the prefill, free queue after the free, hit.
CASES = {
    (None, False): (
        [3, 7, 11, 15],
        [20, 22, 19, 18, 16, 15, 14, 12, 11, 10, 8, 7, 6, *range(24, 40), 21, 17, 13, 9]
        + [5, 4, 3, 2, 1, 23],
        64,
    ),
    (None, True): (
        [3, 4, 7, 8, 11, 12, 15, 16],
        [19, 20, 16, 15, 12, 11, 8, 7, 6, *range(24, 40), 21, 18, 17, 14, 13, 10, 9, 22]
        + [5, 4, 3, 2, 1, 23],
        48,
    ),
    (0, False): (
        [15],
        [20, 23, 22, *range(19, 5, -1), *range(24, 40), 21, 5, 4, 3, 2, 1],
        64,
    ),
    (0, True): (
        [11, 12],
        [21, 23, 22, 20, 19, *range(16, 5, -1), *range(24, 40), 18, 17, 5, 4, 3, 2, 1],
        48,
    ),
    (32, True): (
        [7, 8, 11, 12, 15, 16],
        [19, 23, 20, 16, 15, *range(12, 5, -1), *range(24, 40), 21, 18, 17, 14, 13, 22]
        + [5, 4, 3, 2, 1],
        48,
    ),
}


@pytest.mark.parametrize(("retention", "use_eagle"), list(CASES))
def test_only_reachable_window_blocks_are_cached(retention, use_eagle) -> None:
    positions, free_order, num_hit_tokens = CASES[(retention, use_eagle)]
    manager, request, prefill_events, _ = run(retention, use_eagle)
    if use_eagle:
        full_event, tail_event, window_event = prefill_events
        assert_prompt_tail_entry(tail_event, request)
    else:
        full_event, window_event = prefill_events
    assert isinstance(window_event, BlockStored) and window_event.group_idx == 1
    assert full_event.block_hashes == [request.block_hashes[4 * i + 3] for i in range(4)]
    assert window_event.block_hashes == [request.block_hashes[i] for i in positions]
    # The event covers the call's whole range (EAGLE groups cache one block further).
    assert window_event.token_ids == list(range(68 if use_eagle else 64))
    assert window_event.parent_block_hash is None
    # Unhashed window blocks went to the head of the queue when freed: reused first.
    assert manager.block_pool.free_block_ids() == free_order
    for prompt in (list(range(70)), list(range(70)) + [5, 5, 5]):
        hits, num_tokens, _ = manager.get_computed_blocks(make_request("b", prompt, 4))
        assert num_tokens == num_hit_tokens
        full_hits, window_hits = hits.get_block_ids()
        assert full_hits == [1, 2, 3, 4][: num_hit_tokens // 16]
        assert window_hits == [0] * (num_hit_tokens // 4 - 1) + [window_hits[-1]]


def assert_prompt_tail_entry(event: BlockStored, request) -> None:
    """The full-attention group's sub-block entry at the prompt's last hash boundary (68)."""
    assert isinstance(event, BlockStored)
    assert (event.group_idx, event.block_size, event.token_ids) == (0, 4, list(range(64, 68)))
    assert event.block_hashes == [request.block_hashes[16]]
    assert event.parent_block_hash == request.block_hashes[15]


def test_a_decode_step_with_nothing_reachable_still_reports_its_range() -> None:
    _, request, _, decode_events = run(0, False)
    full_event, tail_event, window_event = decode_events
    assert_prompt_tail_entry(tail_event, request)
    assert (full_event.group_idx, len(full_event.block_hashes)) == (0, 1)
    # Every new window block was masked: an event with no hashes, the step's 16 tokens.
    assert window_event.block_hashes == [] and len(window_event.token_ids) == 16


def test_retention_interval_must_fit_the_model() -> None:
    groups = [KVCacheGroupSpec(("full",), full(16)), KVCacheGroupSpec(("window",), swa(4, 4))]
    with pytest.raises(ConfigError, match=r"multiple of scheduler_block_size \(16\)"):
        KVCacheManager(KVCacheConfig(40, groups, prefix_cache_retention_interval=24), 8192)
    only_full = [KVCacheGroupSpec(("full",), full(16))]
    with pytest.raises(ConfigError, match="no sliding-window or Mamba group"):
        KVCacheManager(KVCacheConfig(40, only_full, prefix_cache_retention_interval=32), 8192)
    KVCacheManager(KVCacheConfig(40, only_full, prefix_cache_retention_interval=0), 8192)


@pytest.mark.parametrize(("retention", "use_eagle"), [(0, False), (32, True)])
def test_an_interval_set_after_construction_acts_as_one_given_at_it(retention, use_eagle) -> None:
    built = run(retention, use_eagle)
    set_after = run(retention, use_eagle, set_after=True)
    manager = set_after[0]
    assert manager.coordinator.retention_interval == retention
    assert all(m.retention_interval == retention for m in manager.coordinator.single_type_managers)
    assert set_after[2:] == built[2:]  # the same events, prefill and decode
    assert manager.block_pool.free_block_ids() == CASES[(retention, use_eagle)][1]


@pytest.mark.parametrize("bad", [-1, 8, True, 1.5])
def test_a_bad_interval_is_refused_and_changes_nothing(bad) -> None:
    manager = make_manager(32, False)
    with pytest.raises(InvalidArgumentError, match=f"got {bad!r}"):
        manager.set_retention_interval(bad)
    assert manager.coordinator.retention_interval == 32
    assert all(m.retention_interval == 32 for m in manager.coordinator.single_type_managers)
