"""Which engine gets a new request, of the replicas up (--data-parallel-routing):

- least-loaded: the fewest unfinished requests, ties broken in rotation.
- cache-aware (the default): the replica believed to hold the longest prefix
  of the prompt's KV blocks (frontend/prefix_index.py), so that requests
  sharing a system prompt or a conversation's earlier turns meet where it
  is computed already. Of equal matches the least loaded wins. A busy
  replica loses its claim as in SGLang's router: when its load exceeds the
  least-loaded replica's by more than BALANCE_ABS_THRESHOLD requests and
  BALANCE_REL_THRESHOLD times, the least-loaded replica takes the request.
  When no replica holds the prompt's first block: least-loaded.
- round-robin: strictly in turn.

Loads. An API server knows its own requests exactly, and those of the other
API servers only from the DP coordinator's EngineLoads, which lag behind. So
the estimate for an engine is the published count plus the change in this
server's own requests there since that publication (sent minus finished),
and never less than this server's own unfinished requests there.

Prefixes. An API server knows the prompts it sent itself; with several
(--api-server-count) each must learn where the others sent theirs. The
engines tell: an engine that took a request adds its prompt's block hashes
(which its prefix cache computed anyway) to its next EngineLoad, and the
coordinator passes them on in the load table that every API server already
receives (EngineLoads.new_prompt_blocks; core/launch/dp_coordinator.py). That is
the simplest that works: no new socket, message kind or process plan; the
report comes from the replica that really took the request (one retried
after a death is reported where it ran); and it arrives with the loads the
balancer already folds in. Each API server relaying its own decisions would
need a socket from every API server to the coordinator; engines reporting
every block their cache stores and evicts (vLLM's KV events) would be exact
but need hooks in the KV cache manager and report generated blocks too,
while the index's bound already forgets what the engine must have evicted.
The API server still records its own picks at once, so that a burst of
requests with a new prefix does not wait for the round trip.

A replica that is down is never picked, and what it held is forgotten: its
cache died with it. Thread-safe: requests are picked on the event loop,
publications arrive on the engine client's output thread.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Literal

from fleet.config.fleet import FleetConfig
from fleet.core.messages import EngineLoads
from fleet.frontend.prefix_index import PrefixIndex, prompt_block_hashes

if TYPE_CHECKING:
    from fleet.frontend.engine_client import EngineClient

Routing = Literal["least-loaded", "cache-aware", "round-robin"]
BALANCE_ABS_THRESHOLD = 32
"""Unfinished requests by which the replica holding a prefix may exceed the least-loaded one (SGLang's default)."""
BALANCE_REL_THRESHOLD = 1.5
"""... or, if that is exceeded, the factor (SGLang's default): both must be exceeded to route by load."""

PREFIX, LEAST_LOADED, IMBALANCE, ROUND_ROBIN = "prefix", "least_loaded", "imbalance", "round_robin"
"""Why a replica was picked (fleet:routing_decisions_total's reason)."""


def imbalanced(load: int, least_load: int) -> bool:
    """Whether a replica of `load` is too busy, next to one of `least_load`, to be sent work for its cache."""
    return load - least_load > BALANCE_ABS_THRESHOLD and load > BALANCE_REL_THRESHOLD * least_load


class LoadBalancer:
    def __init__(self, dp_ranks: list[int], routing: Routing = "least-loaded", block_size: int = 16,
                 kv_blocks: list[int] | None = None, on_decision: Callable[[str], None] | None = None):
        """
        Args:
            dp_ranks: the data-parallel rank of each engine index.
            routing: the policy (--data-parallel-routing).
            block_size: tokens per KV block (--block-size), for cache-aware routing.
            kv_blocks: each engine's KV cache in blocks (cache-aware routing only): no more than
                that many of its blocks are believed cached.
            on_decision: called with why each pick picked (PREFIX, ...), outside the lock.
        """
        self.dp_ranks = dp_ranks
        """Data-parallel rank of each engine index."""
        count = len(dp_ranks)
        self.routing = routing
        self.block_size = block_size
        self.indexes: list[PrefixIndex] | None = None
        """What each replica is believed to hold (cache-aware routing)."""
        if routing == "cache-aware":
            if kv_blocks is None or len(kv_blocks) != count:
                raise ValueError(f"cache-aware routing needs the KV blocks of each of the {count} engines, got {kv_blocks}")
            self.indexes = [PrefixIndex(blocks) for blocks in kv_blocks]
        self.on_decision = on_decision
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

    def pick(self, num_requests: int = 1, prompt_token_ids: Sequence[int] | None = None,
             among: Collection[int] | None = None) -> int | None:
        """The engine index for `num_requests` new requests (the sequences of
        one prompt), counted as sent; None while every replica is down.
        `prompt_token_ids`: their prompt, for cache-aware routing. `among`: the
        engine indexes that may take them (prefill or decode replicas); None: all."""
        hashes = self._hashes(prompt_token_ids)  # outside the lock: sha256 of each full block
        with self._lock:
            candidates = [index for index in self._rotation() if among is None or index in among]
            if not candidates:
                return None
            choice, reason = self._choose(candidates, hashes)
            self._next = (choice + 1) % len(self.up)
            self.own[choice] += num_requests
            self.own_change_since_published[choice] += num_requests
            if hashes:
                self.indexes[choice].add(hashes)
        if self.on_decision is not None:
            self.on_decision(reason)
        return choice

    def _hashes(self, prompt_token_ids: Sequence[int] | None) -> list[bytes]:
        if self.indexes is None or prompt_token_ids is None or len(self.up) < 2:
            return []
        limit = max(index.capacity for index in self.indexes)  # no replica holds more
        return prompt_block_hashes(prompt_token_ids, self.block_size, limit)

    def _rotation(self) -> list[int]:
        """The replicas up, the one after the last pick first."""
        count = len(self.up)
        return [index for index in ((self._next + i) % count for i in range(count)) if self.up[index]]

    def _choose(self, candidates: list[int], hashes: list[bytes]) -> tuple[int, str]:
        if self.routing == "round-robin":
            return candidates[0], ROUND_ROBIN
        loads = self.estimates()
        least = min(candidates, key=loads.__getitem__)  # min keeps the first of equals
        if not hashes:
            return least, LEAST_LOADED
        matched = {index: self.indexes[index].match(hashes) for index in candidates}
        best = max(candidates, key=lambda index: (matched[index], -loads[index]))  # of equal matches the least loaded
        if not matched[best]:
            return least, LEAST_LOADED
        if imbalanced(loads[best], loads[least]):
            return least, IMBALANCE
        return best, PREFIX

    def set_up(self, engine_index: int, up: bool) -> None:
        with self._lock:
            self.up[engine_index] = up
            if self.indexes is not None:
                self.indexes[engine_index].clear()  # down: its cache died; up: it starts empty

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
                if self.indexes is not None and rank < len(loads.new_prompt_blocks) and self.up[index]:
                    self.indexes[index].add(loads.new_prompt_blocks[rank])


def routing_balancer(config: FleetConfig, client: EngineClient,
                     on_decision: Callable[[str], None] | None = None) -> LoadBalancer:
    """The balancer that --data-parallel-routing asks for over the engines of
    `client` (connected). Cache-aware routing needs prefix caching and several
    engines, else it is least-loaded; it asks each engine its KV capacity."""
    dp_ranks = [int.from_bytes(identity, "little") for identity in client.engine_identities]
    routing = config.parallel.data_parallel_routing
    if routing == "cache-aware" and not (config.cache.enable_prefix_caching and len(dp_ranks) > 1):
        routing = "least-loaded"
    kv_blocks = None
    if routing == "cache-aware":
        kv_blocks = [client.call_utility("kv_stats", engine_index=index)["num_blocks"] for index in range(len(dp_ranks))]
    return LoadBalancer(dp_ranks, routing, config.cache.block_size, kv_blocks, on_decision)
