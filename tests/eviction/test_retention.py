"""Retention hints (TensorRT-LLM's KvCacheRetentionConfig): the priority of a block, the
eviction order they give under every policy, durations, the cap, events and metrics."""

from __future__ import annotations

import pytest

from pagedkv import BlockStored, InvalidArgumentError, InvalidTypeError, Request
from pagedkv.retention import DEFAULT_PRIORITY, RetentionConfig, TokenRangeRetention
from tests.support.builders import admit, make_request
from tests.support.eviction import ALL_POLICIES, eviction_config, policy_manager

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def hints(*ranges, decode_priority: int = DEFAULT_PRIORITY) -> RetentionConfig:
    return RetentionConfig(tuple(TokenRangeRetention(*r) for r in ranges), decode_priority)


# ---------------------------------------------------------------------------- the hints


def test_bad_hints_name_the_value():
    with pytest.raises(InvalidArgumentError, match="priority=101"):
        TokenRangeRetention(0, 4, 101)
    with pytest.raises(InvalidArgumentError, match="token_end=4"):
        TokenRangeRetention(4, 4, 50)
    with pytest.raises(InvalidArgumentError, match="duration_s=0"):
        TokenRangeRetention(0, None, 50, 0)
    with pytest.raises(InvalidArgumentError, match=r"overlap: \[0, 8\) and \[4, 12\)"):
        hints((0, 8, 50), (4, 12, 60))
    with pytest.raises(InvalidArgumentError, match="decode_priority=-1"):
        RetentionConfig((), decode_priority=-1)
    with pytest.raises(InvalidTypeError, match="RetentionConfig"):
        Request("r", [1, 2], retention={"priority": 100})  # type: ignore[arg-type]


def test_a_block_takes_the_highest_priority_of_its_tokens():
    config = hints((0, 6, 100, 30.0), (6, 10, 10), decode_priority=60)
    prompt = 12
    assert config.block_priority(0, 4, prompt) == (100, 30.0)
    assert config.block_priority(4, 8, prompt) == (100, 30.0)  # tokens 4-5 at 100
    assert config.block_priority(8, 12, prompt) == (35, None)  # 8-9 at 10, 10-11 default
    assert config.block_priority(12, 16, prompt) == (60, None)  # decode
    low = hints((0, None, 5))
    assert low.block_priority(0, 4, 6) == (5, None)
    assert low.block_priority(4, 8, 6) == (35, None)  # reaches past the prompt: decode default


# ---------------------------------------------------------------------------- the order


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_low_priority_goes_first_and_high_priority_last_under_every_policy(policy):
    manager = policy_manager(
        policy, 8, BS, eviction=eviction_config(policy, retention=True, clock=Clock())
    )
    requests = {
        "pinned": hints((0, None, 100)),
        "plain": None,
        "scratch": hints((0, None, 0)),
    }
    ids = {}
    for offset, (name, retention) in enumerate(requests.items()):
        request = make_request(
            name, list(range(100 * offset, 100 * offset + 8)), BS, retention=retention
        )
        ids[name], _ = admit(manager, request)
        manager.free(request)
        manager.check_invariants()
    free_ids = manager.block_pool.free_block_ids()
    assert free_ids[0] == 7  # the one never-cached block
    assert set(free_ids[1:3]) == set(ids["scratch"])
    assert set(free_ids[-2:]) == set(ids["pinned"])
    # A pool full of pinned blocks still admits: retained blocks are evicted last, not never.
    big = make_request("big", list(range(900, 928)), BS)
    new_ids, _ = admit(manager, big)
    assert sorted(new_ids) == list(range(1, 8))
    manager.check_invariants()


def test_durations_lapse_to_the_default_priority():
    clock = Clock()
    manager = policy_manager(
        "lru", 8, BS, eviction=eviction_config("lru", retention=True, clock=clock)
    )
    specs = [("brief", hints((0, None, 100, 5.0))), ("plain", None), ("kept", hints((0, None, 60)))]
    for offset, (name, retention) in enumerate(specs):
        request = make_request(
            name, list(range(10 * offset, 10 * offset + 4)), BS, retention=retention
        )
        admit(manager, request)
        manager.free(request)
    assert manager.block_pool.free_block_ids()[-3:] == [2, 3, 1]  # plain, kept (60), brief (100)
    clock.now_s += 6.0  # brief's 5 s lapse: it rejoins the LRU order as if freed now
    taken = [admit(manager, make_request(f"n{i}", [500 + i] * 4, BS))[0] for i in range(7)]
    assert [ids[0] for ids in taken] == [4, 5, 6, 7, 2, 1, 3]
    assert manager.get_eviction_stats().num_retention_lapses == 1


def test_a_hit_by_a_hinting_request_raises_the_priority_and_refreshes_the_duration():
    clock = Clock()
    manager = policy_manager(
        "lru", 8, BS, eviction=eviction_config("lru", retention=True, clock=clock)
    )
    first = make_request("first", list(range(9)), BS)
    admit(manager, first)  # blocks 1 2 cached, 3 partial
    manager.free(first)
    again = make_request("again", list(range(9)), BS, retention=hints((0, None, 90, 10.0)))
    assert admit(manager, again) == ([3], 8)
    assert manager.get_eviction_stats().num_retained_blocks == 2
    manager.free(again)
    assert manager.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    clock.now_s += 9.0
    plain = make_request("plain", list(range(9)), BS)  # a plain hit restarts the 10 s
    admit(manager, plain)
    manager.free(plain)
    clock.now_s += 9.0  # 18 s after the raise, 9 s after the last use
    fill = make_request("fill", list(range(500, 524)), BS)  # 6 blocks: 5 free, 1 evicted
    new_ids, _ = admit(manager, fill)
    assert new_ids == [3, 4, 5, 6, 7, 2]
    stats = manager.get_eviction_stats()
    assert (stats.num_retained_blocks, stats.num_retention_lapses) == (1, 0)
    clock.now_s += 2.0  # now past the refreshed duration
    assert admit(manager, make_request("one", [7] * 4, BS))[0] == [1]
    assert manager.get_eviction_stats().num_retention_lapses == 1
    manager.check_invariants()


def test_the_cap_demotes_raises_beyond_it_and_counts_them():
    manager = policy_manager(
        "arc",
        11,
        BS,
        eviction=eviction_config("arc", retention=True, max_retained_fraction=0.3),
        enable_kv_cache_events=True,
    )  # 10 usable blocks: at most 3 retained
    request = make_request("sys", list(range(21)), BS, retention=hints((0, None, 100)))
    admit(manager, request)
    stats = manager.get_eviction_stats()
    assert (stats.num_retained_blocks, stats.num_retention_demotions) == (3, 2)
    stored = [e for e in manager.take_events() if type(e) is BlockStored]
    assert stored[0].retention_priorities == [100, 100, 100, 35, 35]
    manager.free(request)
    manager.check_invariants()


def test_retention_off_ignores_hints_and_events_carry_no_priorities():
    manager = policy_manager("lru", 8, BS, enable_kv_cache_events=True)
    request = make_request("r", list(range(9)), BS, retention=hints((0, None, 100)))
    admit(manager, request)
    manager.free(request)
    assert manager.block_pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    assert [e.retention_priorities for e in manager.take_events()] == [None]
    assert manager.get_eviction_stats().num_retained_blocks == 0
