"""Waiting queues and victim selection of the scheduling policies."""

from __future__ import annotations

import pytest

from pagedkv import Request
from pagedkv.errors import RequestStateError
from pagedkv.sched import FCFSPolicy, PriorityPolicy


def make(request_id: str, priority: int = 0, arrival_time: float = 0.0) -> Request:
    return Request(request_id, [1, 2, 3], priority=priority, arrival_time=arrival_time)


def test_fcfs_queue_appends_and_prepends():
    queue = FCFSPolicy().make_waiting_queue()
    a, b, c, d = make("a"), make("b"), make("c"), make("d")
    queue.add(a)
    queue.add(b)
    queue.prepend(c)
    queue.prepend(d)  # the latest preempted goes first
    assert [r.request_id for r in queue] == ["d", "c", "a", "b"]
    assert queue.peek() is d and len(queue) == 4
    queue.remove(a)
    assert [queue.pop().request_id for _ in range(3)] == ["d", "c", "b"]
    assert len(queue) == 0 and a not in queue
    with pytest.raises(IndexError):
        queue.peek()
    with pytest.raises(RequestStateError, match="not in the waiting queue"):
        queue.remove(a)


def test_queues_reject_a_request_twice():
    for policy in (FCFSPolicy(), PriorityPolicy()):
        queue = policy.make_waiting_queue()
        request = make("x")
        queue.add(request)
        with pytest.raises(RequestStateError, match="already waiting"):
            queue.prepend(request)


def test_priority_queue_orders_by_priority_then_arrival_with_lazy_removal():
    queue = PriorityPolicy().make_waiting_queue()
    late_urgent = make("late-urgent", priority=0, arrival_time=5.0)
    early_urgent = make("early-urgent", priority=0, arrival_time=1.0)
    relaxed = make("relaxed", priority=3, arrival_time=0.0)
    tie = make("tie", priority=0, arrival_time=1.0)  # same key as early-urgent, added later
    for request in (relaxed, late_urgent, early_urgent, tie):
        queue.add(request)
    assert [r.request_id for r in queue] == ["early-urgent", "tie", "late-urgent", "relaxed"]
    queue.remove(early_urgent)
    assert early_urgent not in queue and len(queue) == 3
    assert queue.pop() is tie
    queue.prepend(early_urgent)  # back at its place by key, not at the front
    assert [queue.pop().request_id for _ in range(3)] == ["early-urgent", "late-urgent", "relaxed"]


def test_victims():
    running = [make("a", 0, 0.0), make("b", 2, 1.0), make("c", 2, 3.0), make("d", 1, 4.0)]
    assert FCFSPolicy().select_victim(running).request_id == "d"
    # Lowest priority (largest value); among equals the latest arrival.
    assert PriorityPolicy().select_victim(running).request_id == "c"
