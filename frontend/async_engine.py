"""AsyncEngine: what an API server's handlers call. It turns engine outputs,
which arrive on the EngineClient's thread, into per-request asyncio
notifications, and aborts a request whose consumer goes away. When a replica
dies (and its launcher restarts it), a request of it that had no token yet is
sent to another replica; one that had tokens ends with an error naming it."""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import NamedTuple

import msgspec

from fleet.config.fleet import FleetConfig
from fleet.core.launch.node_plan import ClientAddresses
from fleet.core.messages import EngineCoreOutputs, EngineLoads, KVTransferParams
from fleet.core.sampling_params import SamplingParams
from fleet.frontend.engine_client import EngineClient, EngineDeadError, ReplicaDown
from fleet.frontend.load_balancer import LoadBalancer, routing_balancer
from fleet.frontend.metrics import Metrics
from fleet.frontend.output_processor import RequestState, RequestTracker, child_requests

logger = logging.getLogger(__name__)


class ServerStopping(Exception):
    """The drain after SIGTERM ended before the request did: HTTP 503, or a
    final error event on a stream, instead of a connection cut mid-answer."""


class NoReplicaUp(Exception):
    """None of the replicas a request may run on is up, and it does not wait for one."""


class ReplicaLost(NamedTuple):
    """Put in a request's queue when the replica it runs on died."""

    engine: int
    reason: str


REPLICA_WAIT_S = 0.05
"""How often a request that found every replica down looks again."""


class _Tracked:
    """A running request: its state, its event loop queue, its replica and its timings."""

    def __init__(self, state: RequestState, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop):
        self.state = state
        self.queue = queue
        self.loop = loop
        self.engine: int | None = None
        """The engine index it was sent to (the output thread reads it to fail it when that replica dies)."""
        self.lost = False
        """Whether it was told that replica died (once per send: see AsyncEngine._replica_lock)."""
        self.arrival = time.monotonic()
        self.last_token_at: float | None = None
        self.among: frozenset[int] | None = None
        """The engine indexes it may run on (--disaggregate: the prefill or the decode replicas); None: any."""
        self.waits_for_replicas = True
        """Whether it waits while none of them is up (a prefill gives up instead: the decode replica computes it)."""


class AsyncEngine:
    def __init__(self, config: FleetConfig, tokenizer, client_index: int, addresses: ClientAddresses, metrics: Metrics,
                 load_address: str | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        survives = self._on_replica_change if config.parallel.restarts_replicas else None
        self.client = EngineClient(config, self._on_outputs, self._on_death, client_index, addresses,
                                   load_address, self._on_loads, survives)
        self.client_index = client_index
        self.balancer: LoadBalancer | None = None
        self.prefill_engines: frozenset[int] | None = None
        """--disaggregate: the engine indexes of the prefill replicas (the others decode); None without."""
        self._tracked: RequestTracker[_Tracked] = RequestTracker()
        metrics.tracked_requests.set_function(self.num_unfinished)
        self._ids = itertools.count()
        self._stopping: ServerStopping | None = None
        self._replica_lock = threading.Lock()
        """Sending a request and a replica's death race; under this lock exactly one of them tells the
        request its replica died: the death if it saw the request there, else the sender after its send."""

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    def num_unfinished(self) -> int:
        """Engine requests of this API server not finished yet (a request with n > 1 counts n)."""
        return len(self._tracked)

    def connect(self, num_engines: int) -> None:
        self.client.connect_engines(num_engines)
        self.balancer = routing_balancer(self.config, self.client, self.metrics.routing_decision)
        if self.config.parallel.disaggregation is not None:
            prefill_ranks = self.config.parallel.prefill_ranks()
            self.prefill_engines = frozenset(i for i, rank in enumerate(self.balancer.dp_ranks) if rank in prefill_ranks)
        for dp_rank in self.balancer.dp_ranks:
            self.metrics.replica_up(dp_rank).set(1)

    def replica_states(self) -> list[dict]:
        """Each replica of this API server: up, or down and why (/health?verbose)."""
        down = dict(self.client.down)
        return [{"replica": rank, "state": "down", "reason": down[index]} if index in down
                else {"replica": rank, "state": "up"} for index, rank in enumerate(self.balancer.dp_ranks)]

    async def generate(
        self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
        pooling: str | None = None, kv_transfer: KVTransferParams | None = None, phase: str | None = None,
    ) -> AsyncIterator[RequestState]:
        """Yield the request's state each time it changes, until it finishes.
        Leaving the loop early (client gone) aborts the request in the engine.
        `pooling`: an embedding request (its state's output gets the embedding).
        With --disaggregate a prefill replica computes the prompt first (_prefill_apart);
        `phase` "prefill" is that step's own request."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._stopping is not None:
            raise self._stopping
        if phase is None and kv_transfer is None and self._prefills_apart(prompt_token_ids, params, pooling):
            kv_transfer = await self._prefill_apart(prompt_token_ids, priority)
        request_id = f"{self.client_index}-{next(self._ids)}"
        tracked = _Tracked(RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer), asyncio.Queue(), asyncio.get_running_loop())
        if self.prefill_engines is not None:
            all_engines = frozenset(range(len(self.balancer.dp_ranks)))
            tracked.among = self.prefill_engines if phase == "prefill" else all_engines - self.prefill_engines
            tracked.waits_for_replicas = phase != "prefill"
        children = child_requests(request_id, prompt_token_ids, params, time.time(), self.client_index, priority,
                                  pooling, kv_transfer)
        state = tracked.state
        try:  # from here on, whatever fails (a send, the client leaving) leaves nothing tracked
            self._tracked.add(children, tracked)
            await self._send(children, tracked)
            self.metrics.prompt_tokens(self.balancer.dp_ranks[tracked.engine]).inc(len(prompt_token_ids))
            while not state.output.finished:
                index, update = await tracked.queue.get()
                if isinstance(update, ServerStopping):
                    raise update
                if isinstance(update, ReplicaLost):
                    await self._after_replica_lost(update, children, tracked)
                    continue
                # Outputs are folded in here, on the event loop, so a handler never
                # sees a state that the output thread is half-way through changing.
                if index is None:
                    state.fail(update)
                elif state.apply(index, update):
                    self.client.abort([children[index].request_id], tracked.engine)  # a stop string ended it
                if state.output.finished and phase is None:
                    dp_rank = self.balancer.dp_ranks[tracked.engine]
                    self.metrics.observe_finished(state.output, params, time.monotonic() - tracked.arrival, dp_rank)
                yield state
        finally:
            unfinished = [c.request_id for c, seq in zip(children, state.output.outputs) if not seq.finished]
            self._tracked.remove(child.request_id for child in children)
            if tracked.engine is not None:
                self.balancer.finished(tracked.engine, len(children))
                if unfinished and self.dead_reason is None:
                    self.client.abort(unfinished, tracked.engine)

    def _prefills_apart(self, prompt_token_ids: list[int], params: SamplingParams, pooling: str | None) -> bool:
        """--disaggregate, and a prompt long enough to be worth moving (min_prompt_tokens) that the decode
        replica need not compute itself (prompt logprobs and embeddings need every position computed there)."""
        if self.prefill_engines is None or pooling is not None or params.prompt_logprobs is not None:
            return False
        return len(prompt_token_ids) >= self.config.parallel.disaggregation.min_prompt_tokens

    async def _prefill_apart(self, prompt_token_ids: list[int], priority: int) -> KVTransferParams | None:
        """Have a prefill replica compute the prompt (one token, which is dropped) and keep its KV;
        the params with which a decode replica pulls it. None when no prefill replica could: the
        decode replica computes the prompt itself."""
        state = None
        try:
            async for state in self.generate(None, prompt_token_ids, SamplingParams(max_tokens=1), priority,
                                             kv_transfer=KVTransferParams(do_remote_decode=True), phase="prefill"):
                pass
        except (ReplicaDown, NoReplicaUp) as error:
            logger.warning("the decode replica computes a prompt itself: %s", error)
            return None
        params = state.output.kv_transfer_params if state is not None else None
        return msgspec.convert(params, KVTransferParams) if params is not None else None

    async def _send(self, children: list, tracked: _Tracked) -> None:
        """Send a request's children to the replica that the balancer picks of those
        up, waiting while none is (the launcher is restarting them)."""
        while True:
            engine = self.balancer.pick(len(children), children[0].prompt_token_ids, tracked.among)
            if engine is not None:
                break
            if not tracked.waits_for_replicas:
                raise NoReplicaUp("no prefill replica is up")
            if self.dead_reason is not None:
                raise EngineDeadError(self.dead_reason)
            if self._stopping is not None:
                raise self._stopping
            await asyncio.sleep(REPLICA_WAIT_S)
        with self._replica_lock:
            tracked.engine, tracked.lost = engine, False
        try:
            for child in children:
                self.client.add_request(child, engine)
        except ReplicaDown:
            pass  # it died before its death was seen here: told below, or by the death
        with self._replica_lock:
            if engine in self.client.down and not tracked.lost:
                tracked.lost = True
                tracked.queue.put_nowait((None, ReplicaLost(engine, self.client.down.get(engine, "down"))))

    async def _after_replica_lost(self, lost: ReplicaLost, children: list, tracked: _Tracked) -> None:
        """A request whose replica died is sent again if nothing of it can have
        reached the client yet; otherwise it ends with an error naming the replica."""
        dp_rank = self.balancer.dp_ranks[lost.engine]
        self.balancer.finished(lost.engine, len(children))
        tracked.engine = None
        if not tracked.state.shows_nothing():
            raise ReplicaDown(f"replica dp{dp_rank} died while this request ran: {lost.reason}")
        tracked.state.restart()
        tracked.last_token_at = None
        self.metrics.requests_retried.inc()
        await self._send(children, tracked)

    # ---- called on the EngineClient's output thread ----------------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
        if self.client.down and self._index_of_rank(outputs.engine_index) in self.client.down:
            return  # what a dead replica sent before its death was seen: its requests are elsewhere now
        if outputs.scheduler_stats is not None:
            self.metrics.observe_scheduler(outputs.scheduler_stats, outputs.engine_index)
        for tracked, index, output in self._tracked.route(outputs.outputs):
            self._observe_timing(tracked, len(output.new_token_ids), now, outputs.engine_index)
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, (index, output))

    def _observe_timing(self, tracked: _Tracked, num_new: int, now: float, dp_rank: int) -> None:
        if not num_new:
            return
        self.metrics.generation_tokens(dp_rank).inc(num_new)
        if tracked.last_token_at is None:
            self.metrics.time_to_first_token.observe(now - tracked.arrival)
        else:
            self.metrics.inter_token_latency.observe((now - tracked.last_token_at) / num_new)
        tracked.last_token_at = now

    def _on_loads(self, loads: EngineLoads) -> None:
        if self.balancer is not None:
            self.balancer.publish(loads)

    def _index_of_rank(self, dp_rank: int) -> int:
        return self.balancer.dp_ranks.index(dp_rank)

    def _on_replica_change(self, index: int, reason: str | None) -> None:
        """A replica went down (`reason`) or came back (None)."""
        dp_rank = self.balancer.dp_ranks[index]
        self.balancer.set_up(index, reason is None)
        self.metrics.replica_up(dp_rank).set(reason is None)
        if reason is None:
            self.metrics.replica_restarts(dp_rank).inc()
            return
        with self._replica_lock:
            for tracked in self._tracked.all():
                if tracked.engine == index and not tracked.lost:
                    tracked.lost = True
                    tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, (None, ReplicaLost(index, reason)))

    def _on_death(self, reason: str) -> None:
        for tracked in self._tracked.all():
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, (None, reason))

    def stop_unfinished(self, reason: str) -> None:
        """End every request in flight, and refuse new ones, with ServerStopping
        (they are aborted in the engines as their handlers leave)."""
        self._stopping = ServerStopping(reason)
        for tracked in self._tracked.all():
            tracked.queue.put_nowait((None, self._stopping))

    def shutdown(self) -> None:
        self.client.shutdown(timeout=0)
