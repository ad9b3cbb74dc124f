"""AsyncEngine: what an API server's handlers call. It turns engine outputs,
which arrive on the EngineClient's thread, into per-request asyncio
notifications, and aborts a request whose consumer goes away."""
from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator

from fleet.config.fleet import FleetConfig
from fleet.core.messages import EngineCoreOutputs, EngineLoads
from fleet.core.node_plan import ClientAddresses
from fleet.core.sampling_params import SamplingParams
from fleet.frontend.engine_client import EngineClient, EngineDeadError
from fleet.frontend.load_balancer import LoadBalancer
from fleet.frontend.metrics import Metrics
from fleet.frontend.output_processor import RequestState, RequestTracker, child_requests


class ServerStopping(Exception):
    """The drain after SIGTERM ended before the request did: HTTP 503, or a
    final error event on a stream, instead of a connection cut mid-answer."""


class _Tracked:
    """A running request: its state, its event loop queue and its timings."""

    def __init__(self, state: RequestState, queue: asyncio.Queue, loop: asyncio.AbstractEventLoop):
        self.state = state
        self.queue = queue
        self.loop = loop
        self.arrival = time.monotonic()
        self.last_token_at: float | None = None


class AsyncEngine:
    def __init__(self, config: FleetConfig, tokenizer, client_index: int, addresses: ClientAddresses, metrics: Metrics,
                 load_address: str | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.client = EngineClient(config, self._on_outputs, self._on_death, client_index, addresses,
                                   load_address, self._on_loads)
        self.client_index = client_index
        self.balancer: LoadBalancer | None = None
        self._tracked: RequestTracker[_Tracked] = RequestTracker()
        metrics.tracked_requests.set_function(self.num_unfinished)
        self._ids = itertools.count()
        self._stopping: ServerStopping | None = None

    @property
    def dead_reason(self) -> str | None:
        return self.client.dead_reason

    def num_unfinished(self) -> int:
        """Engine requests of this API server not finished yet (a request with n > 1 counts n)."""
        return len(self._tracked)

    def connect(self, num_engines: int) -> None:
        self.client.connect_engines(num_engines)
        self.balancer = LoadBalancer([int.from_bytes(i, "little") for i in self.client.engine_identities])

    async def generate(
        self, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0,
        pooling: str | None = None,
    ) -> AsyncIterator[RequestState]:
        """Yield the request's state each time it changes, until it finishes.
        Leaving the loop early (client gone) aborts the request in the engine.
        `pooling`: an embedding request (its state's output gets the embedding)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._stopping is not None:
            raise self._stopping
        request_id = f"{self.client_index}-{next(self._ids)}"
        tracked = _Tracked(RequestState(request_id, prompt, prompt_token_ids, params, self.tokenizer), asyncio.Queue(), asyncio.get_running_loop())
        children = child_requests(request_id, prompt_token_ids, params, time.time(), self.client_index, priority,
                                  pooling)
        engine = self.balancer.pick(len(children))
        state = tracked.state
        try:  # from here on, whatever fails (a send, the client leaving) leaves nothing tracked
            self._tracked.add(children, tracked)
            for child in children:
                self.client.add_request(child, engine)
            dp_rank = self.balancer.dp_ranks[engine]
            self.metrics.prompt_tokens(dp_rank).inc(len(prompt_token_ids))
            while not state.output.finished:
                index, update = await tracked.queue.get()
                if isinstance(update, ServerStopping):
                    raise update
                # Outputs are folded in here, on the event loop, so a handler never
                # sees a state that the output thread is half-way through changing.
                if index is None:
                    state.fail(update)
                elif state.apply(index, update):
                    self.client.abort([children[index].request_id], engine)  # a stop string ended it
                if state.output.finished:
                    self.metrics.observe_finished(state.output, params, time.monotonic() - tracked.arrival, dp_rank)
                yield state
        finally:
            self.balancer.finished(engine, len(children))
            unfinished = [c.request_id for c, seq in zip(children, state.output.outputs) if not seq.finished]
            self._tracked.remove(child.request_id for child in children)
            if unfinished and self.dead_reason is None:
                self.client.abort(unfinished, engine)

    # ---- called on the EngineClient's output thread ----------------------------------------

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        now = time.monotonic()
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
