"""Bounded prefix replay (vLLM 0.33's `SlidingWindowMLASpec(bounded_replay=True)`): a window
whose blocks never enter the prefix cache. The other groups decide a hit; the replayed group
gets no hit blocks, the null block where the window no longer reaches and fresh blocks for the
rest (the scheduler recomputes the window); it publishes nothing. The reference scheduler,
which does not replay, refuses it."""

from __future__ import annotations

import pytest

from pagedkv import BlockStored, ConfigError, InvalidArgumentError, ReplayedSlidingWindowSpec
from pagedkv.sched import Scheduler
from tests.support.hybrid import admit, full, make_manager, make_request


def replayed(block_size: int, sliding_window: int) -> ReplayedSlidingWindowSpec:
    return ReplayedSlidingWindowSpec(block_size, 1, 8, 2, sliding_window=sliding_window)


def test_the_paged_group_decides_the_hit_and_the_window_is_rebuilt() -> None:
    spec = replayed(4, 8)
    assert not spec.prefix_cacheable and spec.prefix_replay_tokens == 8
    manager = make_manager(40, full(4), spec, enable_kv_cache_events=True)
    prompt = list(range(26))
    first = make_request("a", prompt, 4)
    assert admit(manager, first)[1].get_block_ids() == (
        [1, 2, 3, 4, 5, 6, 7],
        [8, 9, 10, 11, 12, 13, 14],
    )
    events = manager.take_events()
    # Six full blocks of the paged group are cached; the window's blocks never are.
    assert [(type(e), e.group_idx, len(e.block_hashes)) for e in events] == [(BlockStored, 0, 6)]
    manager.free(first)
    manager.check_invariants()
    # Uncached blocks (the whole window, then the paged group's partial block) go to the
    # head of the free queue, last first.
    assert manager.block_pool.free_block_ids()[:8] == [14, 13, 12, 11, 10, 9, 8, 7]

    second = make_request("b", prompt, 4)
    blocks, num_hit_tokens, _ = manager.get_computed_blocks(second)
    assert blocks.get_block_ids() == ([1, 2, 3, 4, 5, 6], []) and num_hit_tokens == 24
    num_hit, new_blocks = admit(manager, second)
    assert num_hit == 24 and new_blocks.get_block_ids() == ([14], [13, 12, 11])
    # 24 computed tokens: the next token's window starts at 17, so positions 0-3 are null.
    assert manager.get_block_ids("b") == ([1, 2, 3, 4, 5, 6, 14], [0, 0, 0, 0, 13, 12, 11])
    assert manager.take_events() == []  # the hit's blocks were cached already
    manager.check_invariants()


def test_a_hit_handed_in_with_blocks_for_the_replayed_group_is_refused() -> None:
    manager = make_manager(40, full(4), replayed(4, 8))
    prompt = list(range(26))
    first = make_request("a", prompt, 4)
    admit(manager, first)
    manager.free(first)
    second = make_request("b", prompt, 4)
    blocks, num_hit_tokens, _ = manager.get_computed_blocks(second)
    paged = blocks.blocks[0]
    forged = manager.create_kv_cache_blocks((list(paged), list(paged[:2])))
    free_before = manager.block_pool.free_block_ids()
    with pytest.raises(InvalidArgumentError, match="group 1 has 2 hit blocks"):
        manager.allocate_slots(second, 2, num_hit_tokens, forged)
    assert manager.block_pool.free_block_ids() == free_before  # nothing changed
    manager.check_invariants()


def test_the_reference_scheduler_refuses_a_replayed_group_with_caching_on() -> None:
    with pytest.raises(ConfigError, match=r"group 1 \(ReplayedSlidingWindowSpec\) is rebuilt by"):
        Scheduler(make_manager(40, full(4), replayed(4, 8), max_model_len=64))
    Scheduler(make_manager(40, full(4), replayed(4, 8), max_model_len=64, enable_caching=False))
