"""Scheduler layer: scheduling policies (waiting-queue order and preemption victim).

A policy is an object injected into the `Scheduler`; it owns no request state of its own beyond
the waiting queue it creates. Knows nothing of blocks or budgets.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Protocol

from pagedkv.errors import RequestStateError
from pagedkv.request import Request


class WaitingQueue(Protocol):
    """Requests waiting for admission, in the order the policy admits them."""

    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __iter__(self) -> Iterator[Request]: ...
    def __contains__(self, request: object) -> bool: ...


class SchedulingPolicy(Protocol):
    """Chooses the waiting order and the request to preempt when blocks run out."""

    name: str

    def make_waiting_queue(self) -> WaitingQueue: ...
    def select_victim(self, running: Sequence[Request]) -> Request: ...


class FCFSWaitingQueue:
    """First come, first served; preempted requests go back to the front.

    Invariant: iteration order is admission order; every operation is O(1): two
    insertion-ordered dicts, one for prepended requests (read newest first) and one for
    appended requests (read oldest first), give O(1) removal by id.
    """

    __slots__ = ("_front", "_back")

    def __init__(self) -> None:
        self._front: dict[str, Request] = {}
        self._back: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self._check_absent(request)
        self._back[request.request_id] = request

    def prepend(self, request: Request) -> None:
        self._check_absent(request)
        self._front[request.request_id] = request

    def peek(self) -> Request:
        if self._front:
            return self._front[next(reversed(self._front))]
        if self._back:
            return self._back[next(iter(self._back))]
        raise IndexError("peek from an empty waiting queue")

    def pop(self) -> Request:
        request = self.peek()
        self.remove(request)
        return request

    def remove(self, request: Request) -> None:
        request_id = request.request_id
        if self._front.get(request_id) is request:
            del self._front[request_id]
        elif self._back.get(request_id) is request:
            del self._back[request_id]
        else:
            raise RequestStateError(f"request {request_id!r} is not in the waiting queue")

    def _check_absent(self, request: Request) -> None:
        if request.request_id in self._front or request.request_id in self._back:
            raise RequestStateError(f"request {request.request_id!r} is already waiting")

    def __len__(self) -> int:
        return len(self._front) + len(self._back)

    def __iter__(self) -> Iterator[Request]:
        yield from reversed(self._front.values())
        yield from self._back.values()

    def __contains__(self, request: object) -> bool:
        if not isinstance(request, Request):
            return False
        request_id = request.request_id
        return self._front.get(request_id) is request or self._back.get(request_id) is request


class PriorityWaitingQueue:
    """Lowest `(priority, arrival_time)` first (a smaller priority value is more urgent).

    A heap with lazy deletion: `remove` forgets the live entry and `peek` skips stale heap
    entries. Ties keep insertion order. Invariant: `_live` maps each waiting request's id to
    the sequence number of its one live heap entry.
    """

    __slots__ = ("_heap", "_live", "_counter")

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._live: dict[str, tuple[int, Request]] = {}
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        if request.request_id in self._live:
            raise RequestStateError(f"request {request.request_id!r} is already waiting")
        sequence = next(self._counter)
        self._live[request.request_id] = (sequence, request)
        heapq.heappush(self._heap, (request.priority, request.arrival_time, sequence, request))

    # A preempted request goes back to its place by (priority, arrival time).
    prepend = add

    def peek(self) -> Request:
        heap = self._heap
        live = self._live
        while heap:
            _, _, sequence, request = heap[0]
            entry = live.get(request.request_id)
            if entry is not None and entry[0] == sequence:
                return request
            heapq.heappop(heap)  # stale: removed or re-added since
        raise IndexError("peek from an empty waiting queue")

    def pop(self) -> Request:
        request = self.peek()
        heapq.heappop(self._heap)
        del self._live[request.request_id]
        return request

    def remove(self, request: Request) -> None:
        if request not in self:
            raise RequestStateError(f"request {request.request_id!r} is not in the waiting queue")
        del self._live[request.request_id]

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[Request]:
        ordered = sorted(
            (request.priority, request.arrival_time, sequence, request.request_id)
            for sequence, request in self._live.values()
        )
        return iter([self._live[request_id][1] for *_, request_id in ordered])

    def __contains__(self, request: object) -> bool:
        if not isinstance(request, Request):
            return False
        entry = self._live.get(request.request_id)
        return entry is not None and entry[1] is request


class FCFSPolicy:
    """First come, first served: admit in arrival order; preempt the last running request."""

    name = "fcfs"

    def make_waiting_queue(self) -> FCFSWaitingQueue:
        return FCFSWaitingQueue()

    def select_victim(self, running: Sequence[Request]) -> Request:
        return running[-1]


class PriorityPolicy:
    """Admit by `(priority, arrival_time)`; preempt the running request with the largest key
    (the lowest priority, latest arrival among equals)."""

    name = "priority"

    def make_waiting_queue(self) -> PriorityWaitingQueue:
        return PriorityWaitingQueue()

    def select_victim(self, running: Sequence[Request]) -> Request:
        return max(running, key=_priority_key)


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)
