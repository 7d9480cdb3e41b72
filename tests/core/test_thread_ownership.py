"""One owner thread for the manager, its pool and the scheduler, tested with real threads: a
second thread's change raises `ThreadOwnershipError` before anything changes, nothing is
corrupted, and ownership can be handed over."""

from __future__ import annotations

import random
import sys
import threading

import pytest

from pagedkv import Request, RequestStatus
from pagedkv.errors import ThreadOwnershipError
from pagedkv.sched import Scheduler, SchedulerConfig
from tests.support.builders import snapshot
from tests.support.hybrid import admit, full, make_manager, make_request, swa


def in_thread(function, name: str):
    """Run `function()` in a new thread called `name`; its result or the exception it raised."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append(function())
        except Exception as exc:  # handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    return outcome[0]


def serve_requests(manager, seed: int, num_requests: int, start: threading.Barrier) -> None:
    """Admit, decode and free requests over a shared prefix, as an engine thread would."""
    rng = random.Random(seed)
    shared = [rng.randrange(50) for _ in range(32)]
    start.wait()
    for index in range(num_requests):
        prompt = shared + [rng.randrange(32000) for _ in range(rng.randrange(1, 40))]
        request = make_request(f"{seed}-{index}", prompt, 16)
        num_hit, blocks = admit(manager, request)
        if blocks is None:
            continue
        request.status = RequestStatus.RUNNING
        for _ in range(rng.randrange(1, 40)):
            request.append_output_token_ids(7)
            if manager.allocate_slots(request, 1) is None:
                break
            request.num_computed_tokens += 1
        manager.free(request)


def test_two_threads_hammering_one_manager_one_is_refused_nothing_corrupted():
    manager = make_manager(300, full(16), max_model_len=2048, enable_kv_cache_events=True)
    start = threading.Barrier(2)
    errors: dict[str, BaseException] = {}

    def hammer(seed: int) -> None:
        try:
            serve_requests(manager, seed, 1500, start)
        except BaseException as exc:  # noqa: BLE001 - collected for the test
            errors[threading.current_thread().name] = exc

    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as CPython allows
    try:
        threads = [threading.Thread(target=hammer, args=(s,), name=f"engine-{s}") for s in (1, 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch_interval)
    assert len(errors) == 1, errors
    [(loser, error)] = errors.items()
    winner = "engine-2" if loser == "engine-1" else "engine-1"
    assert isinstance(error, ThreadOwnershipError)
    assert (error.calling_thread, error.owner_thread) == (loser, winner)
    assert f"thread {loser!r}" in str(error) and f"thread {winner!r}" in str(error)
    manager.check_invariants()
    # The winner freed everything it allocated; the loser never got a block.
    assert manager.block_pool.get_num_free_blocks() == 299
    assert not any(m.req_to_blocks for m in manager.coordinator.single_type_managers)


def running_request(manager, request_id: str, num_tokens: int, block_size: int = 16) -> Request:
    request = make_request(request_id, list(range(1000, 1000 + num_tokens)), block_size)
    assert admit(manager, request)[1] is not None
    request.status = RequestStatus.RUNNING
    return request


@pytest.mark.parametrize(
    "call",
    [
        "allocate_slots admission",
        "allocate_slots decode into a new block",
        "allocate_slots decode that fills a block (caching)",
        "allocate_decode_slots",
        "free",
        "pop_blocks_for_free",
        "cache_blocks",
        "reset_prefix_cache",
        "take_events",
        "evict_blocks",
    ],
)
def test_a_second_threads_change_is_refused_and_changes_nothing(call):
    manager = make_manager(40, full(16), max_model_len=2048, enable_kv_cache_events=True)
    running = running_request(manager, "owned", 32)  # the test's thread owns the manager now
    waiting = make_request("new", list(range(5000, 5040)), 16)
    if call == "allocate_slots decode that fills a block (caching)":
        running.append_output_token_ids(list(range(15)))  # 47 tokens: the 48th fills block 3
        assert manager.allocate_slots(running, 15) is not None
        running.num_computed_tokens = 47
    running.append_output_token_ids(7)
    actions = {
        "allocate_slots admission": lambda: manager.allocate_slots(waiting, 40),
        "allocate_slots decode into a new block": lambda: manager.allocate_slots(running, 1),
        "allocate_slots decode that fills a block (caching)": lambda: manager.allocate_slots(
            running, 1
        ),
        "allocate_decode_slots": lambda: manager.allocate_decode_slots([running]),
        "free": lambda: manager.free(running),
        "pop_blocks_for_free": lambda: manager.pop_blocks_for_free(running),
        "cache_blocks": lambda: manager.cache_blocks(running, 32),
        "reset_prefix_cache": manager.reset_prefix_cache,
        "take_events": manager.take_events,
        "evict_blocks": lambda: manager.evict_blocks({1, 2}),
    }
    before = snapshot(manager)
    error = in_thread(actions[call], "intruder")
    assert isinstance(error, ThreadOwnershipError), error
    assert error.calling_thread == "intruder"
    assert error.owner_thread == threading.current_thread().name
    assert snapshot(manager) == before
    manager.check_invariants()
    result = actions[call]()  # the owner may
    if call == "pop_blocks_for_free":
        manager.block_pool.free_blocks(reversed(result))
    manager.check_invariants()


def test_a_decode_step_that_changes_nothing_is_not_checked():
    """The hot path's common case (the current block has room) changes nothing, so it is not
    checked: the check costs the decode step nothing."""
    manager = make_manager(40, full(16), max_model_len=2048)
    request = running_request(manager, "r", 20)  # block 2 has 12 free slots
    request.append_output_token_ids(7)
    before = snapshot(manager)
    assert in_thread(lambda: manager.allocate_slots(request, 1), "reader") is (
        manager.empty_kv_cache_blocks
    )
    assert snapshot(manager) == before


def test_a_sliding_window_move_from_another_thread_is_refused_before_the_table_changes():
    manager = make_manager(60, full(4), swa(4, 8), max_model_len=512)
    request = running_request(manager, "r", 24, block_size=4)
    request.num_computed_tokens = 24
    # Decode up to the step that moves the window by a block (the fast path's window free).
    while True:
        request.append_output_token_ids(7)
        before = snapshot(manager)
        error = in_thread(lambda: manager.allocate_slots(request, 1), "intruder")
        if error is manager.empty_kv_cache_blocks:  # nothing to change: not checked
            assert snapshot(manager) == before
        else:
            assert isinstance(error, ThreadOwnershipError), error
            assert snapshot(manager) == before
            break
        assert manager.allocate_slots(request, 1) is manager.empty_kv_cache_blocks
        request.num_computed_tokens += 1
    manager.check_invariants()


def test_the_pool_alone_refuses_another_thread():
    manager = make_manager(20, full(16), max_model_len=512)
    pool = manager.block_pool
    blocks = pool.get_new_blocks(3)  # the test's thread owns the pool (and the manager)
    before = pool.free_block_ids()
    for action in (lambda: pool.free_blocks(blocks), lambda: pool.get_new_blocks(1)):
        assert isinstance(in_thread(action, "intruder"), ThreadOwnershipError)
        assert pool.free_block_ids() == before
    assert isinstance(in_thread(lambda: manager.free(make_request("x", [1], 16)), "t"),
                      ThreadOwnershipError)  # fmt: skip
    pool.free_blocks(blocks)
    pool.check_invariants()


def test_release_owner_thread_hands_the_manager_over():
    manager = make_manager(40, full(16), max_model_len=2048)
    request = running_request(manager, "moved", 16)
    # Another thread may not take it while the owner lives...
    assert isinstance(in_thread(lambda: manager.free(request), "next"), ThreadOwnershipError)
    assert isinstance(in_thread(manager.release_owner_thread, "next"), ThreadOwnershipError)
    # ...until the owner hands it over.
    manager.release_owner_thread()

    def continue_elsewhere() -> int:
        request.append_output_token_ids(7)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        manager.free(request)
        return manager.block_pool.get_num_free_blocks()

    assert in_thread(continue_elsewhere, "next") == 39
    # "next" has ended: its successor (this thread) takes over without a release.
    manager.check_invariants()
    assert running_request(manager, "back", 16) is not None


def test_the_scheduler_refuses_a_request_added_from_another_thread():
    manager = make_manager(200, full(16), max_model_len=512)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=512, max_model_len=512))
    first = make_request("a", list(range(40)), 16)
    first.max_tokens = 4
    scheduler.add_request(first)
    output = scheduler.schedule()
    late = make_request("b", list(range(100, 140)), 16)
    late.max_tokens = 4
    error = in_thread(lambda: scheduler.add_request(late), "api-thread")
    assert isinstance(error, ThreadOwnershipError)
    assert "Scheduler.add_request" in str(error) and "this Scheduler" in str(error)
    assert list(scheduler.requests) == ["a"]
    scheduler.check_invariants()
    assert isinstance(in_thread(scheduler.schedule, "api-thread"), ThreadOwnershipError)
    scheduler.update_from_output(output, {"a": [7]})
    scheduler.check_invariants()
    # Handed over, the scheduler and its manager run in the new thread.
    scheduler.release_owner_thread()

    def run_to_the_end() -> int:
        scheduler.add_request(late)
        num_steps = 0
        while scheduler.has_unfinished_requests():
            step = scheduler.schedule()
            sampled = {
                s.request.request_id: [7] for s in step.scheduled if s.is_prefill_chunk_complete
            }
            scheduler.update_from_output(step, sampled)
            num_steps += 1
        return num_steps

    assert in_thread(run_to_the_end, "engine") > 0
    scheduler.check_invariants()
    assert manager.block_pool.get_num_free_blocks() == 199
