"""The single-owner thread rule itself (`pagedkv.owner_thread`), with real threads."""

from __future__ import annotations

import threading

from pagedkv.errors import PagedKVError, ThreadOwnershipError
from pagedkv.owner_thread import OwnerThread


def in_thread(function, name: str):
    """Run `function()` in a new thread called `name`; its result or the exception it raised."""
    outcome: list = []

    def target() -> None:
        try:
            outcome.append(function())
        except BaseException as exc:  # handed back to the test
            outcome.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    return outcome[0]


def test_the_first_thread_that_checks_owns_it_and_another_is_refused_by_name():
    owner = OwnerThread("the thing", "thing.release()")
    assert owner.owner_name() is None
    owner.check("change")  # the test's thread claims it
    assert owner.owner_name() == threading.current_thread().name
    error = in_thread(lambda: owner.check("KVCacheManager.free"), "intruder")
    assert isinstance(error, ThreadOwnershipError)
    assert isinstance(error, PagedKVError) and isinstance(error, RuntimeError)
    assert error.owner_thread == threading.current_thread().name
    assert error.calling_thread == "intruder"
    message = str(error)
    assert "KVCacheManager.free called from thread 'intruder'" in message
    assert f"thread {threading.current_thread().name!r}" in message
    assert "owns the thing" in message and "thing.release()" in message
    owner.check("change again")  # the owner is still the owner


def test_release_hands_it_to_the_next_thread_that_changes_it():
    owner = OwnerThread("the thing", "thing.release()")
    owner.check("change")
    owner.release()
    assert owner.owner_name() is None
    assert in_thread(lambda: owner.check("change"), "next-owner") is None
    # The new owner ended: anyone may take it over (no thread can still be using it).
    owner.check("take over")
    assert owner.owner_name() == threading.current_thread().name


def test_only_the_owner_may_release():
    owner = OwnerThread("the thing", "thing.release()")
    owner.check("change")
    error = in_thread(owner.release, "thief")
    assert isinstance(error, ThreadOwnershipError)
    assert owner.owner_name() == threading.current_thread().name


def test_two_threads_claiming_at_once_one_wins():
    owner = OwnerThread("the thing", "thing.release()")
    start = threading.Barrier(8)
    claimed = threading.Barrier(9)  # the eight and the test
    results: dict[str, object] = {}
    done = threading.Event()

    def claim() -> None:
        name = threading.current_thread().name
        start.wait()
        try:
            owner.check("change")
            results[name] = "owner"
        except ThreadOwnershipError as exc:
            results[name] = exc
        claimed.wait()
        done.wait()  # stay alive: a finished owner could be taken over

    threads = [threading.Thread(target=claim, name=f"claimer-{i}") for i in range(8)]
    for thread in threads:
        thread.start()
    claimed.wait()
    done.set()
    for thread in threads:
        thread.join()
    winners = [name for name, result in results.items() if result == "owner"]
    assert len(winners) == 1
    for name, result in results.items():
        if name not in winners:
            assert isinstance(result, ThreadOwnershipError)
            assert result.owner_thread == winners[0]
