"""The engine core: schedule -> execute -> update -> send, in a loop.

`EngineCore` is the step logic; `python -m fleet.core.engine_core` is the
engine-core process around it, with socket I/O on background threads so that
encoding and decoding overlap the model step.
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from typing import Any

import msgspec
import zmq

from fleet.config.fleet import FleetConfig
from fleet.core import ipc, processes, serial
from fleet.core.dp_coordinator import relays_prompt_blocks
from fleet.core.kv_release import KVReleaseSender
from fleet.core.messages import (
    Abort,
    CoordinatorBroadcast,
    EngineAlive,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineInput,
    EngineLoad,
    FinishReason,
    KVCapacity,
    KVRelease,
    ModelRunnerOutput,
    Ready,
    Shutdown,
    SpecDecodeCounts,
    StepDecision,
    StepVote,
    UtilityCall,
    UtilityResult,
    WaveWakeUp,
)
from fleet.core.node_plan import EngineCorePlan, StartupFacts
from fleet.core.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_LIVENESS_CHECK_S = 0.5
"""How often an engine with nothing to do checks that its workers live."""
ENGINE_BEAT_S = 0.5
"""How often an engine tells every client it lives (EngineAlive), busy or idle."""
KV_RELEASES = -1
"""The output queue's client for KV releases to prefill instances (sent by the output thread)."""
MAX_RELEASE_BYTES = 4096
"""Largest message the KV release socket takes (a KVRelease is about 40 bytes)."""


class EngineCore:
    """Owns the scheduler and the executor of one data-parallel replica."""

    UTILITY_METHODS = ("health", "reset_prefix_cache", "kv_stats", "spec_decode_stats")

    def __init__(self, config: FleetConfig, plan: EngineCorePlan, facts: StartupFacts | None = None):
        from fleet.workers.executor import make_executor  # deferred: the executor picks what it imports

        self.config = config
        self.dp_rank = plan.dp_rank
        self.executor = make_executor(config, plan, facts or StartupFacts())
        self.kv_capacity: KVCapacity = self.executor.start()
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            max_model_len=config.model.max_model_len,
            num_blocks=self.kv_capacity.num_blocks,
            eos_token_ids=config.model.eos_token_ids,
            sliding_window=config.model.sliding_window,
            kv_transfer=config.kv_transfer,
            replica_size=config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size,
            speculative=config.speculative,
        )
        self.kv_release_address: str | None = None
        """Producer: where decode instances say they took a request's KV (bound by the process)."""
        self.client_of_request: dict[str, int] = {}
        self.rejected: list[tuple[int, EngineCoreOutput]] = []
        self.new_prompt_blocks: list[bytes] | None = [] if relays_prompt_blocks(config, plan) else None
        """Prompt blocks taken since the last load() (EngineLoad.new_prompt_blocks); None: not reported."""
        self._log_capacity()

    def _log_capacity(self) -> None:
        capacity = self.kv_capacity
        concurrency = capacity.num_tokens / self.config.model.max_model_len
        logger.info(
            "engine dp%d: KV cache of %d blocks = %d tokens; %.2fx concurrency at max model length %d",
            self.dp_rank, capacity.num_blocks, capacity.num_tokens, concurrency, self.config.model.max_model_len,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the scheduler refuses is answered with an error
        output instead (front ends validate first, so this is a last guard)."""
        try:
            added = self.scheduler.add_request(request)
        except ValueError as error:
            logger.warning("rejected request %s: %s", request.request_id, error)
            rejection = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, error=str(error))
            self.rejected.append((request.client_index, rejection))
            return
        self.client_of_request[request.request_id] = request.client_index
        if self.new_prompt_blocks is not None:
            self.new_prompt_blocks += added.block_hashes

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests([r for r in request_ids if r in self.client_of_request])

    def has_work(self) -> bool:
        scheduler = self.scheduler
        return scheduler.has_unfinished_requests() or scheduler.has_finished_requests() or bool(self.rejected)

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Run one step; return the outputs grouped by the client that gets them."""
        scheduler_output = self.scheduler.schedule()
        # Workers must drop finished requests too; and lock-step replicas all
        # run every step, with no tokens if need be (see dp_coordinator.py).
        workers_have_work = (scheduler_output.num_scheduled_tokens or scheduler_output.finished_request_ids
                             or scheduler_output.kv_exports or scheduler_output.kv_export_releases
                             or self.scheduler.kv_connector.loading)  # the workers say when pulls end
        if workers_have_work or self.config.parallel.replicas_step_together:
            result = self.executor.execute(scheduler_output)
        else:
            result = ModelRunnerOutput(step_id=scheduler_output.step_id, request_ids=[], sampled_token_ids=[])
        outputs = self.scheduler.update_from_output(scheduler_output, result)
        for output in outputs:
            if output.kv_transfer is not None:
                output.kv_transfer.remote_kv_addresses = self.executor.kv_export_addresses
                output.kv_transfer.remote_release_address = self.kv_release_address
        return self._group_by_client(outputs)

    def take_kv_releases(self) -> list[tuple[str, str]]:
        """(release address, transfer id) to tell prefill instances (the process sends them, kv_release.py)."""
        return self.scheduler.kv_connector.take_releases()

    def release_kv(self, transfer_id: str) -> None:
        self.scheduler.kv_connector.release(transfer_id)

    def _group_by_client(self, outputs: list[EngineCoreOutput]) -> dict[int, EngineCoreOutputs]:
        now = time.time()
        grouped: dict[int, EngineCoreOutputs] = {}

        def bucket(client: int) -> list[EngineCoreOutput]:
            if client not in grouped:
                grouped[client] = EngineCoreOutputs(self.dp_rank, [], now)
            return grouped[client].outputs

        for client, output in self.rejected:
            bucket(client).append(output)
        self.rejected.clear()
        for output in outputs:
            client = self.client_of_request.get(output.request_id, 0)
            if output.finish_reason is not None:
                self.client_of_request.pop(output.request_id, None)
            bucket(client).append(output)
        self._attach_stats(grouped)
        return grouped

    def _attach_stats(self, grouped: dict[int, EngineCoreOutputs]) -> None:
        """The scheduler's stats go out with the outputs. The counts since
        the last stats (prefix-cache lookups, preemptions) go to one client
        only, so that the API servers' counters add up; a step with no
        outputs keeps them for the next one that has some."""
        if not grouped:
            return
        stats = self.scheduler.make_stats()
        first, *others = sorted(grouped)
        grouped[first].scheduler_stats = stats
        occupancy = msgspec.structs.replace(stats, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                                              kv_transfer_tokens=0, kv_transfer_failures=0,
                                              spec_decode=SpecDecodeCounts())
        for client in others:
            grouped[client].scheduler_stats = occupancy

    def load(self) -> EngineLoad:
        scheduler = self.scheduler
        blocks = self.new_prompt_blocks or []
        if blocks:
            self.new_prompt_blocks = []
        return EngineLoad(self.dp_rank, len(scheduler.waiting), len(scheduler.running), blocks)

    def utility(self, method: str, args: list[Any]) -> Any:
        if method == "health":
            return True
        if method == "reset_prefix_cache":
            return self.scheduler.kv_cache_manager.reset_prefix_cache()
        if method == "kv_stats":
            manager = self.scheduler.kv_cache_manager
            return {"num_free_blocks": manager.num_free_blocks, "num_blocks": manager.num_blocks}
        if method == "spec_decode_stats":
            return msgspec.structs.asdict(self.scheduler.spec_decode_totals)
        raise ValueError(f"unknown utility {method!r}; choose from {self.UTILITY_METHODS}")

    def shutdown(self) -> None:
        self.executor.shutdown()


# ---- the engine-core process ------------------------------------------------------------


class EngineCoreStartupInfo(msgspec.Struct):
    config: FleetConfig
    plan: EngineCorePlan
    handshake_address: str
    facts: StartupFacts


class EngineCoreProcess:
    def __init__(self, name: str, info: EngineCoreStartupInfo):
        self.name = name
        self.info = info
        # SimpleQueues: every step puts and takes from them, and queue.Queue's
        # Python locks and conditions took about a fifth of this process's time per token.
        self.inputs: queue.SimpleQueue = queue.SimpleQueue()
        self.outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.ctx = zmq.Context()
        self.next_step = 0
        """The lock-step step this engine votes for next."""
        self.woken = False
        self.last_load: EngineLoad | None = None

    def run(self) -> None:
        info = self.info
        self.engine = processes.start_or_report(
            self.name, info.handshake_address, lambda: EngineCore(info.config, info.plan, info.facts)
        )
        self._start_io_threads()
        ready = Ready(self.name, os.getpid(), kv_capacity=self.engine.kv_capacity)
        processes.report(self.info.handshake_address, ready)
        try:
            self._lockstep_loop() if self.info.config.parallel.replicas_step_together else self._busy_loop()
        except Exception as error:
            logger.exception("%s died", self.name)
            self.outputs.put((None, EngineDead(self.info.plan.dp_rank, f"{self.name}: {error}")))
            self._flush_outputs()
            self.engine.shutdown()
            sys.exit(1)
        self.engine.shutdown()
        self._flush_outputs()

    def _busy_loop(self) -> None:
        while True:
            if not self._drain_inputs(block=not self.engine.has_work()):
                return
            if self.engine.has_work():
                self._step()

    def _lockstep_loop(self) -> None:
        """Every step is agreed with the other replicas (dp_coordinator.py):
        vote, wait for the decision, and step, with no tokens if idle."""
        wave_running = False
        while True:
            if not self._drain_inputs(block=not (wave_running or self.woken or self.engine.has_work())):
                return
            self.woken = False
            self._send_to_coordinator(StepVote(self.info.plan.dp_rank, self.next_step, self.engine.has_work()))
            decision = self._await_decision()
            if decision is None:
                return
            self.next_step += 1
            wave_running = decision.run
            if decision.run:
                self._step()

    def _await_decision(self) -> StepDecision | None:
        """The coordinator's decision for our vote; requests that arrive
        meanwhile are queued. None once Shutdown arrived."""
        while True:
            message = self._next_input()
            if isinstance(message, StepDecision):
                assert message.step == self.next_step, (message, self.next_step)
                return message
            if not self._handle(message):
                return None

    def _step(self) -> None:
        for client, outputs in self.engine.step().items():
            self.outputs.put((client, outputs))
        releases = self.engine.take_kv_releases()
        if releases:
            self.outputs.put((KV_RELEASES, releases))
        if self.info.plan.coordinator is not None:
            load = self.engine.load()
            if load != self.last_load or load.new_prompt_blocks:
                self._send_to_coordinator(load)
                self.last_load = load

    def _send_to_coordinator(self, message: StepVote | EngineLoad) -> None:
        self.coordinator.send(serial.encode(message))

    def _drain_inputs(self, block: bool) -> bool:
        """Handle every queued input; False once Shutdown arrived."""
        try:
            message = self._next_input() if block else self.inputs.get_nowait()
        except queue.Empty:
            return True
        while True:
            if not self._handle(message):
                return False
            try:
                message = self.inputs.get_nowait()
            except queue.Empty:
                return True

    def _next_input(self) -> Any:
        """Wait for an input, checking meanwhile that every worker lives: an idle
        engine would otherwise learn of a dead worker only at the next request."""
        while True:
            try:
                return self.inputs.get(timeout=IDLE_LIVENESS_CHECK_S)
            except queue.Empty:
                self.engine.executor.check_alive()  # raises WorkerDied: the engine dies and says why

    def _handle(self, message: Any) -> bool:
        """Act on one input; False for Shutdown."""
        match message:
            case EngineCoreRequest():
                self.engine.add_request(message)
            case Abort(request_ids=ids):
                self.engine.abort(ids)
            case UtilityCall(call_id=call_id, method=method, args=args, client_index=client):
                self.outputs.put((client, self._utility(call_id, method, args)))
            case KVRelease(transfer_id=transfer_id):
                self.engine.release_kv(transfer_id)
            case WaveWakeUp(step=step):
                self.woken = self.woken or step == self.next_step  # else stale: we voted already
            case Shutdown():
                return False
        return True

    def _utility(self, call_id: int, method: str, args: list[Any]) -> UtilityResult:
        try:
            return UtilityResult(call_id, self.engine.utility(method, args))
        except Exception as error:
            return UtilityResult(call_id, error=f"{type(error).__name__}: {error}")

    def _start_io_threads(self) -> None:
        identity = self.info.plan.dp_rank.to_bytes(2, "little")
        dealers = [ipc.make_socket(self.ctx, zmq.DEALER, connect=c.requests, identity=identity)
                   for c in self.info.plan.clients]
        pushes = [ipc.make_socket(self.ctx, zmq.PUSH, connect=c.outputs) for c in self.info.plan.clients]
        subscribers = []
        if self.info.config.kv_transfer is not None and self.info.config.kv_transfer.is_producer:
            releases = ipc.make_socket(self.ctx, zmq.PULL)
            releases.setsockopt(zmq.MAXMSGSIZE, MAX_RELEASE_BYTES)  # anyone on the network may send here
            ipc.bind_tcp(releases, self.info.config.kv_transfer.kv_ip)
            self.engine.kv_release_address = releases.getsockopt_string(zmq.LAST_ENDPOINT)
            subscribers.append(releases)
        for dealer in dealers:
            # Hello, with our pid so that clients can watch us: a ROUTER routes only to peers it has heard from.
            dealer.send(str(self._pid_for_clients()).encode())
        if self.info.plan.coordinator is not None:
            # The main thread owns the PUSH; the input thread the SUB (a zmq socket is single-threaded).
            self.coordinator = ipc.make_socket(self.ctx, zmq.PUSH, connect=self.info.plan.coordinator.engine_inputs)
            # An empty queue at start: a restarted replica replaces what its predecessor last published.
            self.last_load = self.engine.load()
            self._send_to_coordinator(self.last_load)
            sub = ipc.make_socket(self.ctx, zmq.SUB, connect=self.info.plan.coordinator.engine_broadcast)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            subscribers.append(sub)
        threading.Thread(
            target=self._input_thread, args=(dealers, subscribers), name="engine-input", daemon=True
        ).start()
        self._pushes = pushes
        self._kv_releases = KVReleaseSender(self.ctx)
        self._output_sender = threading.Thread(target=self._output_thread, name="engine-output", daemon=True)
        self._output_sender.start()

    def _pid_for_clients(self) -> int:
        """Our pid, or 0 when the clients may run on another machine (node 0
        of an internal-LB job; a Ray actor) and cannot watch it; they learn
        of our death from the job's heartbeat, or from the launcher."""
        parallel = self.info.config.parallel
        remote_node = parallel.nnodes > 1 and parallel.node_rank != 0 and parallel.internal_lb
        return 0 if remote_node or parallel.data_parallel_backend == "ray" else os.getpid()

    def _input_thread(self, dealers: list[zmq.Socket], subscribers: list[zmq.Socket]) -> None:
        client_decoder = serial.Decoder(EngineInput, f"{self.name} input")
        coordinator_decoder = serial.Decoder(CoordinatorBroadcast | KVRelease, f"{self.name} coordinator")
        poller = zmq.Poller()
        for sock in [*dealers, *subscribers]:
            poller.register(sock, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                decoder = coordinator_decoder if sock in subscribers else client_decoder
                message = decoder.decode(sock.recv())
                if message is not None:
                    self.inputs.put(message)

    def _output_thread(self) -> None:
        beat = serial.encode(EngineAlive(self.info.plan.dp_rank))
        next_beat = time.monotonic()
        while True:
            try:
                client, message = self.outputs.get(timeout=ENGINE_BEAT_S)
            except queue.Empty:
                pass
            else:
                if message is None:
                    self._kv_releases.close()
                    return
                if client == KV_RELEASES:
                    self._kv_releases.send(message)
                else:
                    data = serial.encode(message)
                    for push in self._pushes if client is None else [self._pushes[client]]:
                        push.send(data)
            if time.monotonic() >= next_beat:
                for push in self._pushes:
                    push.send(beat)
                next_beat = time.monotonic() + ENGINE_BEAT_S

    def _flush_outputs(self) -> None:
        self.outputs.put((None, None))  # the output thread sends what precedes it, then returns
        self._output_sender.join()
        for push in self._pushes:
            push.setsockopt(zmq.LINGER, 2000)
            push.close()


def main() -> None:
    processes.child_main(EngineCoreStartupInfo, lambda name, info: EngineCoreProcess(name, info).run())


if __name__ == "__main__":
    main()
