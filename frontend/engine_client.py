"""EngineClient: the front end's side of the engine sockets.

It binds one ROUTER (requests out) and one PULL (outputs in), starts the
engine-core processes of this node (fleet.LLM) or meets those the launcher
started (API servers), and hands every output to a callback on its output
thread. It watches the engines: where the launcher restarts a dead replica
(`on_replica_change` given), a death marks that replica down and the hello
of its new engine core marks it up again; otherwise any death is the
client's.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from fleet.config.fleet import FleetConfig
from fleet.core import ipc, serial
from fleet.core.launch import processes
from fleet.core.launch.node_plan import ClientAddresses, StartupFacts, engine_core_plans
from fleet.core.launch.process_names import engine_core_name
from fleet.core.messages import (
    Abort,
    EngineAlive,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineLoads,
    EngineOutput,
    KVCapacity,
    Shutdown,
    UtilityCall,
    UtilityResult,
)

logger = logging.getLogger(__name__)

OutputHandler = Callable[[EngineCoreOutputs], None]
DeathHandler = Callable[[str], None]
LoadHandler = Callable[[EngineLoads], None]
ReplicaHandler = Callable[[int, "str | None"], None]
"""(engine index, why it went down), or (engine index, None) when it is back."""

LIVENESS_CHECK_S = 0.1
ENGINE_SILENCE_LIMIT_S = 3.0
"""An engine on another node (no pid to watch) that sent nothing, not even
its EngineAlive beat, this long is taken for dead (replicas that restart only)."""


class EngineDeadError(RuntimeError):
    """An engine core (or a worker under it) died; the message names it."""


class ReplicaDown(EngineDeadError):
    """The one replica a message was for is down (the launcher restarts it)."""


class EngineClient:
    def __init__(
        self,
        config: FleetConfig,
        on_outputs: OutputHandler,
        on_death: DeathHandler,
        client_index: int = 0,
        addresses: ClientAddresses | None = None,
        load_address: str | None = None,
        on_loads: LoadHandler | None = None,
        on_replica_change: ReplicaHandler | None = None,
    ):
        self.config = config
        self.client_index = client_index
        self.on_outputs = on_outputs
        self.on_death = on_death
        self.ctx = zmq.Context()
        addresses = addresses or ClientAddresses.new()
        self.requests = ipc.make_socket(self.ctx, zmq.ROUTER, bind=addresses.requests)
        self.requests.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.requests.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine core takes its identity over
        self.outputs = ipc.make_socket(self.ctx, zmq.PULL, bind=addresses.outputs)
        self.loads: zmq.Socket | None = None
        if load_address is not None and on_loads is not None:  # the DP coordinator's load table
            self.loads = ipc.make_socket(self.ctx, zmq.SUB, connect=load_address)
            self.loads.setsockopt(zmq.SUBSCRIBE, b"")
        self.on_loads = on_loads
        self.on_replica_change = on_replica_change
        self.engines: list[processes.ChildProcess] = []
        self.foreign_engines: dict[bytes, processes.ForeignProcess] = {}
        """The engines we did not start, by identity, watched by the pid of their hello."""
        self.engine_identities: list[bytes] = []
        self.last_heard: dict[int, float] = {}
        """dp rank -> when it last sent anything (engines on other nodes are watched by their silence)."""
        self.down: dict[int, str] = {}
        """Engine index -> why it is down, while the launcher restarts it."""
        self.kv_capacity: KVCapacity | None = None
        self.dead_reason: str | None = None
        self._send_lock = threading.Lock()
        self._utility_futures: dict[int, tuple[Future, int]] = {}
        """call id -> (its future, the engine index it went to)"""
        self._call_ids = itertools.count()
        self._closed = threading.Event()
        self._stopping = threading.Event()
        self._output_thread: threading.Thread | None = None

    # ---- start-up ------------------------------------------------------------------------

    def start_engines(self) -> None:
        """Spawn this node's engine cores and wait for Ready from each (one deadline)."""
        from fleet.core.launch.engine_launch import start_engine_cores
        from fleet.parallel.dims import node_engine_ranks

        handshake = processes.HandshakeListener(self.ctx)
        addresses = ClientAddresses(self.requests.getsockopt_string(zmq.LAST_ENDPOINT),
                                    self.outputs.getsockopt_string(zmq.LAST_ENDPOINT))
        plans = engine_core_plans(self.config, node_engine_ranks(self.config.parallel), [addresses], None)
        try:
            self.engines.extend(start_engine_cores(self.config, plans, handshake.address, StartupFacts()))
            ready = handshake.wait_all(self.engines, self.config.parallel.distributed_timeout_seconds)
        except Exception:
            handshake.close()
            self.shutdown()
            raise
        handshake.close()
        self.kv_capacity = min((r.kv_capacity for r in ready.values() if r.kv_capacity), key=lambda c: c.num_blocks)
        self.connect_engines(len(self.engines))

    def connect_engines(self, count: int) -> None:
        """Wait for the hello of `count` engines, then start taking their outputs."""
        self._await_engine_hellos(count)
        self._output_thread = threading.Thread(target=self._output_loop, name="engine-client-output", daemon=True)
        self._output_thread.start()

    def _await_engine_hellos(self, count: int) -> None:
        while len(self.engine_identities) < count:
            if not self.requests.poll(self.config.parallel.distributed_timeout_seconds * 1000):
                raise EngineDeadError(
                    f"only {len(self.engine_identities)} of {count} engine cores said hello within "
                    f"{self.config.parallel.distributed_timeout_seconds} s (--distributed-timeout-seconds); "
                    "with --data-parallel-size-local < --data-parallel-size, the other launches must run too"
                )
            identity, hello = self.requests.recv_multipart()
            self.engine_identities.append(identity)
            self._watch_by_pid(identity, int(hello))
        self.engine_identities.sort()

    def _watch_by_pid(self, identity: bytes, pid: int) -> None:
        """Engines we did not start are watched by the pid they said hello
        with (0: on another machine, watched by their silence)."""
        self.last_heard[int.from_bytes(identity, "little")] = time.monotonic()
        if not self.engines and pid:
            name = engine_core_name(int.from_bytes(identity, "little"))
            self.foreign_engines[identity] = processes.ForeignProcess(name, pid)

    def _read_hellos(self) -> None:
        """A restarted engine core says hello again: its replica is up."""
        hellos = []
        with self._send_lock:  # the ROUTER is the senders' socket too
            while self.requests.poll(0):
                hellos.append(self.requests.recv_multipart())
        for identity, hello in hellos:
            if identity not in self.engine_identities:
                logger.warning("hello from an unknown engine %r ignored", identity)
                continue
            index = self.engine_identities.index(identity)
            if index not in self.down:  # restarted before its death was seen
                self._replica_lost(index, f"{engine_core_name(int.from_bytes(identity, 'little'))} restarted")
            self._watch_by_pid(identity, int(hello))
            del self.down[index]
            logger.info("%s is back", engine_core_name(int.from_bytes(identity, "little")))
            self.on_replica_change(index, None)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: EngineCoreRequest, engine_index: int = 0) -> None:
        self._send(engine_index, request)

    def abort(self, request_ids: list[str], engine_index: int = 0) -> None:
        if request_ids and self.dead_reason is None and engine_index not in self.down:
            try:
                self._send(engine_index, Abort(request_ids))
            except ReplicaDown:
                pass  # what it ran died with it

    def call_utility(self, method: str, *args: Any, engine_index: int = 0, timeout: float = 30.0) -> Any:
        call_id = next(self._call_ids)
        future: Future = Future()
        self._utility_futures[call_id] = (future, engine_index)
        self._send(engine_index, UtilityCall(call_id, method, list(args), self.client_index))
        result: UtilityResult = future.result(timeout)
        if result.error:
            raise RuntimeError(result.error)
        return result.result

    def _send(self, engine_index: int, message: Any) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if engine_index in self.down:
            raise ReplicaDown(self.down[engine_index])
        data = serial.encode(message)
        with self._send_lock:
            try:
                self.requests.send_multipart([self.engine_identities[engine_index], data], copy=False)
            except zmq.ZMQError as error:  # EHOSTUNREACH: it died, and we have not seen it yet
                raise ReplicaDown(f"engine dp{int.from_bytes(self.engine_identities[engine_index], 'little')} "
                                  f"unreachable: {error}") from error

    # ---- outputs ---------------------------------------------------------------------------

    def _output_loop(self) -> None:
        decoder = serial.Decoder(EngineOutput, "engine outputs")
        load_decoder = serial.Decoder(EngineLoads, "engine loads")
        poller = zmq.Poller()
        poller.register(self.outputs, zmq.POLLIN)
        if self.loads is not None:
            poller.register(self.loads, zmq.POLLIN)
        next_check = time.monotonic()
        while not self._closed.is_set():
            ready = dict(poller.poll(int(LIVENESS_CHECK_S * 1000)))
            if time.monotonic() >= next_check:  # also under a stream of outputs from the other engines
                next_check = time.monotonic() + LIVENESS_CHECK_S
                self._check_engines_alive()
                if self.on_replica_change is not None:
                    self._read_hellos()
            if self.loads in ready:
                loads = load_decoder.decode(self.loads.recv())
                if loads is not None:
                    self.on_loads(loads)
            if self.outputs not in ready:
                continue
            message = decoder.decode(self.outputs.recv())
            match message:
                case EngineAlive(engine_index=dp_rank):
                    self.last_heard[dp_rank] = time.monotonic()
                case EngineCoreOutputs():
                    self.last_heard[message.engine_index] = time.monotonic()
                    self.on_outputs(message)
                case UtilityResult(call_id=call_id):
                    future, _ = self._utility_futures.pop(call_id, (None, None))
                    if future is not None:
                        future.set_result(message)
                case EngineDead(engine_index=dp_rank, reason=reason):
                    self._engine_lost(self._index_of(dp_rank), reason)

    def _index_of(self, dp_rank: int) -> int:
        return self.engine_identities.index(dp_rank.to_bytes(2, "little"))

    def _check_engines_alive(self) -> None:
        if self.engines:  # ours (fleet.LLM): any death is ours
            dead = [engine for engine in self.engines if not engine.alive()]
            if dead and self.dead_reason is None:
                self._declare_dead("; ".join(engine.describe_exit() for engine in dead))
            return
        for identity, engine in self.foreign_engines.items():
            index = self.engine_identities.index(identity)
            if index not in self.down and not engine.alive():
                self._engine_lost(index, engine.describe_exit())
        if self.on_replica_change is not None:
            self._check_remote_engines_heard()

    def _check_remote_engines_heard(self) -> None:
        """Engines on other nodes: a silent one is gone (its node, or its process)."""
        now = time.monotonic()
        for index, identity in enumerate(self.engine_identities):
            dp_rank = int.from_bytes(identity, "little")
            silence = now - self.last_heard.get(dp_rank, now)
            if identity not in self.foreign_engines and index not in self.down and silence > ENGINE_SILENCE_LIMIT_S:
                self._engine_lost(index, f"{engine_core_name(dp_rank)} on another node sent nothing for {silence:.1f} s")

    def _engine_lost(self, index: int, reason: str) -> None:
        if self.on_replica_change is None:
            self._declare_dead(reason)
        elif index not in self.down and not self._stopping.is_set():
            self._replica_lost(index, reason)

    def _replica_lost(self, index: int, reason: str) -> None:
        self.down[index] = reason
        logger.error("replica dp%d is down (%s): its requests without a token go to the other replicas",
                     int.from_bytes(self.engine_identities[index], "little"), reason)
        for call_id, (future, engine_index) in list(self._utility_futures.items()):
            if engine_index == index:
                self._utility_futures.pop(call_id, None)
                future.set_exception(EngineDeadError(reason))
        self.on_replica_change(index, reason)

    def _declare_dead(self, reason: str) -> None:
        if self.dead_reason is not None or self._stopping.is_set():
            return
        self.dead_reason = f"engine died: {reason}"
        logger.error(self.dead_reason)
        for future, _ in self._utility_futures.values():
            future.set_exception(EngineDeadError(self.dead_reason))
        self.on_death(self.dead_reason)

    # ---- shutdown --------------------------------------------------------------------------

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        # Only engines we started are ours to stop: a launcher's engines serve its other API servers too.
        for identity in self.engine_identities if self.engines else []:
            try:
                self.requests.send_multipart([identity, serial.encode(Shutdown("client shutting down"))], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        processes.stop_all(self.engines, timeout)
        self._closed.set()
        if self._output_thread is not None:
            self._output_thread.join()
        self.ctx.destroy(linger=0)
