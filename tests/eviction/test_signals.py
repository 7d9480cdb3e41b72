"""Online signals from the serving system: the waiting-queue look-ahead, the session estimate,
and the two policies that use it (`continuation`, `hazard`). Exact block orders and counts."""

from __future__ import annotations

import pytest

from pagedkv import ConfigError, Request, RequestStatus
from pagedkv.eviction import EvictionConfig
from pagedkv.eviction.continuation import value_of
from pagedkv.eviction.sessions import (
    NUM_LENGTH_CLASSES,
    NUM_OUTPUT_CLASSES,
    SessionStats,
    gap_bin,
)
from tests.support.builders import admit, free_ids, make_manager, make_request

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def tokens(base: int, num_tokens: int) -> list[int]:
    return [base + i for i in range(num_tokens)]


def serve(manager, request_id: str, prompt: list[int], **kwargs) -> Request:
    """Arrive, be scheduled, compute the prompt, finish and free."""
    request = make_request(request_id, prompt, BS, **kwargs)
    manager.add_waiting(request)
    assert admit(manager, request)[0] is not None
    request.status = RequestStatus.FINISHED_STOPPED
    manager.free(request)
    manager.check_invariants()
    return request


# ---------------------------------------------------------------------------- look-ahead


def test_lookahead_keeps_the_blocks_a_waiting_request_will_hit():
    prompt_a, prompt_b = tokens(100, 9), tokens(200, 9)
    runs = {}
    for lookahead in (False, True):
        manager = make_manager(7, BS, eviction=EvictionConfig(lookahead=lookahead))
        serve(manager, "a", prompt_a)  # blocks 1 2 3; 1 2 cached, 3 back to the head
        serve(manager, "b", prompt_b)  # blocks 3 4 5; 3 4 cached, 5 back to the head
        waiting = make_request("w", prompt_a + tokens(300, 4), BS)
        manager.add_waiting(waiting)
        manager.check_invariants()
        order = free_ids(manager)
        stats = manager.get_eviction_stats()
        # Another request takes four blocks before the waiting one is scheduled.
        other = make_request("c", tokens(400, 16), BS)
        assert admit(manager, other)[0] is not None
        hits, num_hit_tokens, _ = manager.get_computed_blocks(waiting)
        runs[lookahead] = (order, num_hit_tokens, stats)
        manager.check_invariants()
    # LRU: unhashed 5 6 first, then a's tail and head (2 1), then b's (4 3).
    assert runs[False][0] == [5, 6, 2, 1, 4, 3]
    assert runs[False][1] == 0
    # Look-ahead: a's blocks, which "w" will hit, go last (its tail first).
    assert runs[True][0] == [5, 6, 4, 3, 2, 1]
    assert runs[True][1] == 8
    assert runs[True][2].num_protected_blocks == 2
    assert runs[True][2].num_lookahead_protections == 2
    assert runs[False][2].num_protected_blocks == 0


def test_lookahead_protects_blocks_freed_while_a_request_waits_and_lets_go_once_scheduled():
    manager = make_manager(9, BS, eviction=EvictionConfig(policy="lfu", lookahead=True))
    prompt = tokens(100, 9)
    holder = make_request("h", prompt, BS)
    assert admit(manager, holder)[0] == [1, 2, 3]
    waiting = make_request("w", prompt[:8] + tokens(500, 5), BS)
    manager.add_waiting(waiting)  # its blocks are held: nothing to protect yet
    assert manager.get_eviction_stats().num_protected_blocks == 0
    serve(manager, "x", tokens(200, 9))  # blocks 4 5 6, 4 5 cached
    holder.status = RequestStatus.FINISHED_STOPPED
    manager.free(holder)
    manager.check_invariants()
    assert manager.get_eviction_stats().num_protected_blocks == 2
    assert free_ids(manager) == [3, 6, 7, 8, 5, 4, 2, 1]
    # Scheduled: its hits are held, the registration is gone.
    assert admit(manager, waiting)[1] == 8
    manager.check_invariants()
    assert manager.get_eviction_stats().num_protected_blocks == 0
    assert manager.block_pool.eviction_policy.lookahead.num_waiting == {}
    waiting.status = RequestStatus.FINISHED_STOPPED
    manager.free(waiting)
    manager.check_invariants()


def test_lookahead_registration_ends_on_remove_waiting_and_on_free():
    manager = make_manager(7, BS, eviction=EvictionConfig(lookahead=True))
    serve(manager, "a", tokens(100, 9))
    for leave in ("remove_waiting", "free"):
        waiting = make_request(f"w-{leave}", tokens(100, 8) + [1], BS)
        manager.add_waiting(waiting)
        manager.add_waiting(waiting)  # a second registration of the same entry: ignored
        assert manager.get_eviction_stats().num_protected_blocks == 2
        getattr(manager, leave)(waiting)
        manager.check_invariants()
        assert manager.get_eviction_stats().num_protected_blocks == 0
        assert free_ids(manager) == [3, 4, 5, 6, 2, 1]


def test_lookahead_off_and_plain_lru_ignore_the_waiting_queue():
    manager = make_manager(7, BS)
    assert manager._signals is None
    serve(manager, "a", tokens(100, 9))
    manager.add_waiting(make_request("w", tokens(100, 9), BS))
    assert free_ids(manager) == [3, 4, 5, 6, 2, 1]
    with pytest.raises(ConfigError, match="lookahead='yes'"):
        EvictionConfig(lookahead="yes")  # type: ignore[arg-type]


def test_lookahead_with_retention_goes_after_retained_blocks():
    from pagedkv.retention import RetentionConfig, TokenRangeRetention

    manager = make_manager(9, BS, eviction=EvictionConfig(retention=True, lookahead=True))
    high = RetentionConfig((TokenRangeRetention(0, None, priority=90),))
    serve(manager, "r", tokens(100, 9), retention=high)  # 1 2 retained
    serve(manager, "a", tokens(200, 9))  # 3 4 cached
    manager.add_waiting(make_request("w", tokens(200, 8) + [7], BS))
    manager.check_invariants()
    # Unhashed, the retained blocks (high priority), then what "w" will hit.
    assert free_ids(manager) == [5, 6, 7, 8, 2, 1, 4, 3]
    taken = manager.block_pool.get_new_blocks(8)
    assert [block.block_id for block in taken] == [5, 6, 7, 8, 2, 1, 4, 3]


# ---------------------------------------------------------------------------- session stats


class _Seen:
    def __init__(self, request_id, session_id, num_prompt_tokens, num_tokens):
        self.request_id = request_id
        self.session_id = session_id
        self.num_prompt_tokens = num_prompt_tokens
        self.num_tokens = num_tokens


def test_session_stats_count_continuations_per_class_and_gaps():
    clock = Clock()
    stats = SessionStats(clock)
    first = _Seen("a0", "a", 100, 110)
    assert stats.note_arrival(first) == 0
    assert stats.note_arrival(first) == 0  # again (preempted): not a new turn
    klass = stats.class_of(first)
    assert klass == 0  # turn 0, < 512 prompt tokens, < 64 output tokens
    assert stats.note_finished(first) == 0.5  # nothing seen yet: the prior
    clock.now_s = 30.0
    second = _Seen("a1", "a", 3000, 3300)
    assert stats.note_arrival(second) == 1
    assert stats.num_continued[0] == stats.num_finished[0] == 1
    assert stats.gap_counts[gap_bin(30.0)] == 1 and stats.num_gaps == 1
    # Turn 1, 3000 prompt tokens (< 4k: length class 3), 300 output tokens (< 1k: class 2).
    assert stats.class_of(second) == (1 * NUM_LENGTH_CLASSES + 3) * NUM_OUTPUT_CLASSES + 2
    lone = _Seen("b0", None, 100, 110)
    assert stats.note_arrival(lone) == 0
    stats.note_finished(lone)
    # Turn class 0: 1 of 2 continued, smoothed with the prior (0.5, weight 2).
    assert stats.probability(0) == pytest.approx((1 + 1) / (2 + 2))
    stats.check_invariants()
    assert [gap_bin(g) for g in (0.0, 0.99, 1.0, 1.5, 2.0, 30.0)] == [0, 0, 1, 2, 3, 10]


def test_session_stats_forget_the_least_recently_seen_session_beyond_the_bound():
    stats = SessionStats(Clock(), max_sessions=2)
    for name in ("a", "b", "c"):
        stats.note_arrival(_Seen(f"{name}0", name, 10, 10))
    assert list(stats._sessions) == ["b", "c"]
    stats.check_invariants()


# ---------------------------------------------------------------------------- policies


def test_continuation_evicts_an_unlikely_continuation_before_a_likelier_older_one():
    clock = Clock()
    orders = {}
    for policy in ("lru", "continuation"):
        manager = make_manager(8, BS, eviction=EvictionConfig(policy=policy, clock=clock))
        # Four sessions of one turn each: turn 0 continues with (0 + 1) / (4 + 2) = 1/6.
        for index in range(4):
            request = Request(f"t{index}", [1], session_id=f"t{index}")
            manager.add_waiting(request)
            request.status = RequestStatus.FINISHED_STOPPED
            manager.free(request)
        # Session "s": turn 0 (served), then turn 1, which finishes first among the two below.
        serve(manager, "s0", tokens(100, 5), session_id="s")
        likely = serve(manager, "s1", tokens(100, 4) + tokens(150, 5), session_id="s")
        unlikely = serve(manager, "u0", tokens(200, 9), session_id="u")
        orders[policy] = free_ids(manager)
        if policy == "continuation":
            sessions = manager.block_pool.eviction_policy.sessions
            # When u0 was freed, turn 0 had 5 finished and 1 continued (s0): (1 + 1) / (5 + 2);
            # s1 was the first turn 1: the prior, 1/2. Now 6 turns 0 have finished.
            assert sessions.probability(sessions.class_of(unlikely)) == pytest.approx(2 / 8)
            assert value_of(2 / 7) == 19 and value_of(0.5) == 33
        del likely
    # s1 cached blocks 1 (its hit on s0) and 2, u0 blocks 3 and 4; 5 6 7 are unhashed.
    assert orders["lru"] == [5, 6, 7, 2, 1, 4, 3]
    assert orders["continuation"] == [5, 6, 7, 4, 3, 2, 1]


def test_a_preempted_request_is_kept_over_finished_ones():
    manager = make_manager(7, BS, eviction=EvictionConfig(policy="continuation"))
    preempted = make_request("p", tokens(100, 9), BS)
    manager.add_waiting(preempted)
    assert admit(manager, preempted)[0] == [1, 2, 3]
    preempted.status = RequestStatus.RUNNING
    manager.free(preempted)  # freed while RUNNING: a preemption
    serve(manager, "f", tokens(200, 9))  # p = 1/2 (the prior): below a preemption's
    assert free_ids(manager) == [5, 6, 4, 3, 2, 1]


def test_hazard_weighs_class_and_silence():
    clock = Clock()
    manager = make_manager(12, BS, eviction=EvictionConfig(policy="hazard", clock=clock))
    # 16 sessions continue after 10 s and 16 never do: turn 0 continues with 1/2, and every
    # gap seen is 10 s, so a session silent for 50 s has ended.
    for index in range(16):
        for name in (f"c{index}", f"n{index}"):
            request = Request(f"{name}-0", [1], session_id=name)
            manager.add_waiting(request)
            request.status = RequestStatus.FINISHED_STOPPED
            manager.free(request)
    clock.now_s = 10.0
    for index in range(16):
        manager.add_waiting(Request(f"c{index}-1", [1], session_id=f"c{index}"))
    policy = manager.block_pool.eviction_policy
    assert policy.sessions.num_gaps == 16
    clock.now_s = 50.0
    stale = make_request("stale", tokens(100, 9), BS)  # preempted at 50 s: top class
    assert admit(manager, stale)[0] == [1, 2, 3]
    stale.status = RequestStatus.RUNNING
    manager.free(stale)
    clock.now_s = 95.0
    fresh = make_request("fresh", tokens(200, 9), BS)  # preempted at 95 s: top class
    assert admit(manager, fresh)[0] == [3, 4, 5]
    fresh.status = RequestStatus.RUNNING
    manager.free(fresh)
    clock.now_s = 99.0
    # Finished at 99 s: turn 0 continued 16 of 32 times, (16 + 1) / (32 + 2) = 1/2: class 4.
    assert admit(manager, low := make_request("low", tokens(300, 9), BS, session_id="z"))[0] == [
        5,
        6,
        7,
    ]
    low.status = RequestStatus.FINISHED_STOPPED
    manager.free(low)
    clock.now_s = 100.0
    manager.check_invariants()
    # stale: silent 50 s, longer than every gap seen (worth 0); low: class 4, worth 0.5625;
    # fresh: class 7, silent 5 s, worth 0.9375. LRU would give 2 1 4 3 6 5.
    expected = [7, 8, 9, 10, 11, 2, 1, 6, 5, 4, 3]
    assert free_ids(manager) == expected
    assert [block.block_id for block in manager.block_pool.get_new_blocks(11)] == expected
