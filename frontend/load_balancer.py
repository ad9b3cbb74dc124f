"""Which engine gets a new request: of the replicas up, the one with the
fewest unfinished requests, ties broken in rotation.

An API server knows its own requests exactly, and those of the other API
servers only from the DP coordinator's EngineLoads, which lag behind. So
the estimate for an engine is the published count plus the change in this
server's own requests there since that publication (sent minus finished),
and never less than this server's own unfinished requests there. Thread-safe: requests are picked on the event
loop, publications arrive on the engine client's output thread.
"""
from __future__ import annotations

import threading

from fleet.core.messages import EngineLoads


class LoadBalancer:
    def __init__(self, dp_ranks: list[int]):
        self.dp_ranks = dp_ranks
        """Data-parallel rank of each engine index."""
        count = len(dp_ranks)
        self.own = [0] * count
        self.published = [0] * count
        self.own_change_since_published = [0] * count
        self.up = [True] * count
        """False while a replica is down (its launcher restarts it)."""
        self._next = 0
        self._lock = threading.Lock()

    def estimates(self) -> list[int]:
        rows = zip(self.own, self.published, self.own_change_since_published, strict=True)
        return [max(own, published + change) for own, published, change in rows]

    def pick(self, num_requests: int = 1) -> int | None:
        """The engine index for `num_requests` new requests (the sequences of
        one prompt), counted as sent; None while every replica is down."""
        with self._lock:
            loads = self.estimates()
            count = len(loads)
            rotation = [(self._next + i) % count for i in range(count) if self.up[(self._next + i) % count]]
            if not rotation:
                return None
            choice = min(rotation, key=lambda index: loads[index])  # min keeps the first of equals
            self._next = (choice + 1) % count
            self.own[choice] += num_requests
            self.own_change_since_published[choice] += num_requests
            return choice

    def set_up(self, engine_index: int, up: bool) -> None:
        with self._lock:
            self.up[engine_index] = up

    def finished(self, engine_index: int, num_requests: int = 1) -> None:
        with self._lock:
            self.own[engine_index] -= num_requests
            self.own_change_since_published[engine_index] -= num_requests

    def publish(self, loads: EngineLoads) -> None:
        with self._lock:
            for index, rank in enumerate(self.dp_ranks):
                if rank < len(loads.num_waiting):
                    self.published[index] = loads.num_waiting[rank] + loads.num_running[rank]
                    self.own_change_since_published[index] = 0
