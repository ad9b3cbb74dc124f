"""Waiting queues: first come first served, or by priority then arrival."""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator

from fleet.core.request import Request


class FCFSQueue:
    """Waiting requests in arrival order; preempted ones go back to the front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
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


def priority_key(request: Request) -> tuple[int, float]:
    """Lower priority value first, then earlier arrival."""
    return (request.priority, request.arrival_time)


class PriorityQueue:
    """Waiting requests by priority_key; a preempted request takes its place by the same key."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (*priority_key(request), next(self._counter), request))

    prepend = add

    def peek(self) -> Request:
        return self._heap[0][-1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[-1] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (entry[-1] for entry in sorted(self._heap))
