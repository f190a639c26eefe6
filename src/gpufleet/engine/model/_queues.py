"""Waiting queues: first come first served, or by priority (lower value first, then arrival)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from gpufleet.engine.model._request import Request


class WaitingQueue(Protocol):
    def push(self, request: Request) -> None:
        """A new arrival."""

    def push_front(self, request: Request) -> None:
        """A preempted request: it goes back ahead of the requests that arrived after it."""

    def peek(self) -> Request: ...

    def pop(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order; a preempted request goes to the very front (as vLLM's prepend)."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Lowest ``(priority, arrival time, arrival order)`` first. A preempted request keeps its
    key, so it returns ahead of every later arrival of its priority."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, request.seq, request))

    push_front = push

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[3] for entry in sorted(self._heap))
