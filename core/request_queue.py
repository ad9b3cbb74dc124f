"""Waiting queues, fair across groups: first come first served, or by priority then arrival.

A group is one user request's n sequences (Request.group_id); a request with n = 1
is a group of one. The queue also counts each group's running sequences (the
scheduler reports starts and stops), and its head is the head of the group that
runs the fewest of them: a client's n=64 request then takes turns with a one-sequence
chat instead of filling the batch ahead of it. Ties go by the policy's order:
  fcfs      fewest running, then arrival (a preempted request first: it goes back to the front).
  priority  lower priority value first, then fewest running, then arrival: fair share
            never lets a worse priority pass a better one.
A group with no running sequence competes by arrival alone, so it is never passed
for ever by later groups.

Cost: each group keeps its requests in a heap; the groups with waiting requests sit
in one heap by their key, refreshed lazily (a group is pushed again when its head or
running count changes; stale entries are dropped when they surface). add, pop and a
running count change are O(log n); peek is O(1) amortised; remove is O(group size).
"""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator

from fleet.core.request import Request

RequestKey = tuple
"""A request's place in its group: unique, so two keys never tie."""
GroupEntry = tuple[tuple, str]
"""(group key, group id) in the heap of groups."""


def priority_key(request: Request) -> tuple[int, float]:
    """Lower priority value first, then earlier arrival."""
    return (request.priority, request.arrival_time)


class FairShareQueue:
    """Waiting requests by group, and the number of running sequences of each group.
    Subclasses give the policy: `_request_key` orders a group, `_group_key` orders the groups."""

    def __init__(self) -> None:
        self._groups: dict[str, list[tuple[RequestKey, Request]]] = {}
        """Waiting requests of each group that has some, a heap by request key."""
        self._num_running: dict[str, int] = {}
        """Running sequences of each group that has some."""
        self._group_heap: list[GroupEntry] = []
        self._current_entries: dict[str, GroupEntry] = {}
        """The live entry of each group in `_group_heap`; any other entry there is stale."""
        self._size = 0

    def _request_key(self, request: Request, front: bool) -> RequestKey:
        raise NotImplementedError

    def _group_key(self, head: Request, head_key: RequestKey, num_running: int) -> tuple:
        raise NotImplementedError

    # ---- waiting requests ----------------------------------------------------------------

    def add(self, request: Request) -> None:
        self._push(request, self._request_key(request, front=False))

    def prepend(self, request: Request) -> None:
        """A preempted request: back where the policy puts it (the front of its group under fcfs)."""
        self._push(request, self._request_key(request, front=True))

    def peek(self) -> Request:
        return self._groups[self._first_group_id()][0][1]

    def pop(self) -> Request:
        group_id = self._first_group_id()
        _, request = heapq.heappop(self._groups[group_id])
        self._size -= 1
        self._refresh(group_id)
        return request

    def remove(self, request: Request) -> None:
        group = self._groups[request.group_id]
        kept = [entry for entry in group if entry[1] is not request]
        assert len(kept) == len(group) - 1, f"{request} is not waiting"
        heapq.heapify(kept)
        self._groups[request.group_id] = kept
        self._size -= 1
        self._refresh(request.group_id)

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request, group by group, each group in its order."""
        for group in self._groups.values():
            yield from (request for _, request in sorted(group, key=lambda entry: entry[0]))

    # ---- running counts --------------------------------------------------------------------

    def num_running(self, group_id: str) -> int:
        return self._num_running.get(group_id, 0)

    def started_running(self, request: Request) -> None:
        self._num_running[request.group_id] = self.num_running(request.group_id) + 1
        self._refresh(request.group_id)

    def stopped_running(self, request: Request) -> None:
        """It finished, was aborted or was preempted."""
        group_id = request.group_id
        remaining = self._num_running[group_id] - 1
        if remaining:
            self._num_running[group_id] = remaining
        else:
            del self._num_running[group_id]
        self._refresh(group_id)

    # ---- the heap of groups ----------------------------------------------------------------

    def _push(self, request: Request, key: RequestKey) -> None:
        heapq.heappush(self._groups.setdefault(request.group_id, []), (key, request))
        self._size += 1
        self._refresh(request.group_id)

    def _refresh(self, group_id: str) -> None:
        """Give the group a new entry if its head or running count changed (none if nothing of it waits)."""
        group = self._groups.get(group_id)
        if not group:
            self._groups.pop(group_id, None)
            self._current_entries.pop(group_id, None)
            return
        head_key, head = group[0]
        entry = (self._group_key(head, head_key, self.num_running(group_id)), group_id)
        if entry == self._current_entries.get(group_id):
            return
        self._current_entries[group_id] = entry
        heapq.heappush(self._group_heap, entry)
        if len(self._group_heap) > 2 * len(self._current_entries) + 64:
            # Mostly stale: rebuild from the live entries.
            self._group_heap = list(self._current_entries.values())
            heapq.heapify(self._group_heap)

    def _first_group_id(self) -> str:
        heap = self._group_heap
        while heap[0] is not self._current_entries.get(heap[0][1]):
            heapq.heappop(heap)
        return heap[0][1]


class FCFSQueue(FairShareQueue):
    """Fewest running first, then arrival order; preempted requests go back to the front."""

    def __init__(self) -> None:
        super().__init__()
        self._back = itertools.count()
        self._front = itertools.count(-1, -1)

    def _request_key(self, request: Request, front: bool) -> RequestKey:
        return (next(self._front if front else self._back),)

    def _group_key(self, head: Request, head_key: RequestKey, num_running: int) -> tuple:
        return (num_running, head_key)


class PriorityQueue(FairShareQueue):
    """Lower priority value first, then fewest running, then arrival; a preempted
    request takes its place by the same key."""

    def __init__(self) -> None:
        super().__init__()
        self._counter = itertools.count()

    def _request_key(self, request: Request, front: bool) -> RequestKey:
        return (*priority_key(request), next(self._counter))

    def _group_key(self, head: Request, head_key: RequestKey, num_running: int) -> tuple:
        return (head.priority, num_running, head_key)
