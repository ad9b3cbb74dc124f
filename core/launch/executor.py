"""Executors: how the engine core reaches its workers.

`uni` holds the one worker in the engine-core process (for debugging);
`mp` starts one process per worker, broadcasts each SchedulerOutput to all of
them on one XPUB socket (one send, whatever the number of workers) and
reads results from the driver (rank 0) only. This module imports no torch:
the engine-core process stays light with `mp`.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any

import msgspec
import zmq

from fleet.config.fleet import FleetConfig
from fleet.config.parallel import ParallelConfig
from fleet.core import ipc, serial
from fleet.core.executor import Executor
from fleet.core.launch import process_names, processes
from fleet.core.launch.node_plan import EngineCorePlan, StartupFacts, StoreLocation, WorkerPlan
from fleet.core.launch.worker_process import WorkerStartupInfo, build_worker
from fleet.core.messages import (
    KVCapacity,
    ModelRunnerOutput,
    SchedulerOutput,
    Shutdown,
    WorkerDead,
    WorkerOutput,
    WorkerUtilityCall,
    WorkerUtilityResult,
)
from fleet.parallel.dims import coord_of, replica_spans_nodes

logger = logging.getLogger(__name__)

LIVENESS_POLL_MS = 100
"""How often a waiting executor checks that its workers live: death is seen within this."""


class WorkerDied(RuntimeError):
    pass


class UniExecutor(Executor):
    def __init__(self, config: FleetConfig, plan: EngineCorePlan):
        self.config = config
        self.plan = plan

    def start(self) -> KVCapacity:
        (worker,) = self.plan.workers  # config validation allows `uni` for one worker only
        self.worker = build_worker(self.config, worker, store=None)
        num_blocks = self.worker.available_kv_blocks()
        self.worker.init_kv_cache(num_blocks)
        transfer = self.worker.runner.kv_transfer
        self.kv_export_addresses = [transfer.address] if transfer is not None and transfer.address else []
        return KVCapacity(num_blocks, self.config.cache.block_size)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)

    def shutdown(self) -> None:
        pass


class ReplicaAddresses(msgspec.Struct):
    """Where the workers of one replica reach its executor (published in the
    job store when the replica spans nodes)."""

    steps: str
    results: str
    handshake: str
    store: StoreLocation | None
    """Where the replica's workers meet, the port bound."""


class MultiprocExecutor(Executor):
    def __init__(self, config: FleetConfig, plan: EngineCorePlan, facts: StartupFacts):
        self.config = config
        self.plan = plan
        self.dp_rank = plan.dp_rank
        self.facts = facts
        self.ctx = zmq.Context()
        self.tcp_host = self._tcp_bind_host()
        self.steps = self._bind(zmq.XPUB, "steps")
        self.steps.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.results = self._bind(zmq.PULL, "results")
        self.decoder = serial.Decoder(WorkerOutput, "worker results")
        self.workers: list[processes.ChildProcess] = []
        self.call_ids = itertools.count()

    def _tcp_bind_host(self) -> str | None:
        """Workers on other nodes need TCP; local ones are faster on ipc://."""
        parallel = self.config.parallel
        return _node_address(parallel) if replica_spans_nodes(parallel) else None

    def _bind(self, kind: int, tag: str) -> zmq.Socket:
        sock = ipc.make_socket(self.ctx, kind)
        if self.tcp_host is None:
            sock.bind(ipc.new_ipc_address(tag))
        else:
            ipc.bind_tcp(sock, self.tcp_host)
        return sock

    def start(self) -> KVCapacity:
        parallel = self.config.parallel
        store = self.facts.resolve(self.plan.store)
        if store is not None and store.hosted_by == "executor":
            store = self._host_store(store)
        handshake = processes.HandshakeListener(self.ctx, self.tcp_host)
        try:
            addresses = ReplicaAddresses(
                steps=self.steps.getsockopt_string(zmq.LAST_ENDPOINT),
                results=self.results.getsockopt_string(zmq.LAST_ENDPOINT),
                handshake=handshake.address,
                store=store,
            )
            if replica_spans_nodes(parallel):
                self._publish(addresses)
            self.workers = self._spawn(addresses)
            started_here = {worker.rank for worker in self.plan.workers}
            remote = [worker_name(parallel, rank) for rank in self.plan.worker_ranks if rank not in started_here]
            ready = handshake.wait_all(self.workers, parallel.distributed_timeout_seconds, remote)
        finally:
            handshake.close()
        self._wait_for_subscribers(parallel.replica_size)
        exports = [ready[worker_name(parallel, rank)].addresses.get("kv_export") for rank in sorted(self.plan.worker_ranks)]
        self.kv_export_addresses = exports if all(exports) else []
        # Every worker must fit the same number of blocks: the smallest wins.
        num_blocks = min(r.kv_capacity.num_blocks for r in ready.values() if r.kv_capacity)
        self.call("init_kv_cache", [num_blocks])
        return KVCapacity(num_blocks, self.config.cache.block_size)

    def _spawn(self, addresses: ReplicaAddresses) -> list[processes.ChildProcess]:
        return spawn_workers(self.config, self.plan.workers, addresses)

    def _publish(self, addresses: ReplicaAddresses) -> None:
        """For the launchers of the other nodes, which start this replica's workers there."""
        from fleet.core.launch.job_store import JobStore  # torch: only for replicas that span nodes

        JobStore.client(self.config.parallel).publish(f"replica/{self.dp_rank}/executor", addresses)

    def _host_store(self, store: StoreLocation) -> StoreLocation:
        """Host the TCPStore where the replica's workers meet, bound to port 0
        (unless the plan fixed it) so no port is probed and then raced for."""
        from datetime import timedelta

        import torch.distributed as dist  # only replicas of several workers need torch here

        host = self.tcp_host or store.host  # reachable by workers on other nodes (Ray)
        self._store = dist.TCPStore(
            host, store.port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=self.config.parallel.distributed_timeout_seconds),
        )
        return msgspec.structs.replace(store, host=host, port=self._store.port)

    def _wait_for_subscribers(self, count: int) -> None:
        """XPUB hears each subscription: once all workers subscribed, no step is lost."""
        deadline = time.monotonic() + self.config.parallel.distributed_timeout_seconds
        seen = 0
        while seen < count:
            if self.steps.poll(LIVENESS_POLL_MS):
                if self.steps.recv()[:1] == b"\x01":
                    seen += 1
            else:
                self.check_alive()
            if time.monotonic() > deadline:
                raise WorkerDied(f"only {seen} of {count} workers subscribed to the steps")

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.send(serial.encode(scheduler_output))
        result = self._receive(deadline=time.monotonic() + self.config.parallel.engine_step_timeout)
        assert isinstance(result, ModelRunnerOutput), result
        return result

    def call(self, method: str, args: list[Any]) -> Any:
        call_id = next(self.call_ids)
        self.steps.send(serial.encode(WorkerUtilityCall(call_id, method, args)))
        result = self._receive()
        assert isinstance(result, WorkerUtilityResult) and result.call_id == call_id, result
        if result.error:
            raise RuntimeError(f"worker utility {method} failed: {result.error}")
        return result.result

    def _receive(self, deadline: float | None = None) -> ModelRunnerOutput | WorkerUtilityResult:
        """The workers' answer; WorkerDied when one died, or is hung past `deadline`."""
        while True:
            if self.results.poll(LIVENESS_POLL_MS):
                message = self.decoder.decode(self.results.recv())
                if isinstance(message, WorkerDead):
                    raise WorkerDied(self._root_cause(message.reason))
                if message is not None:
                    return message
            else:
                self.check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    timeout = self.config.parallel.engine_step_timeout
                    raise WorkerDied(f"a step of replica dp{self.dp_rank} ran past --engine-step-timeout {timeout:g} s: "
                                     "its workers count as hung")

    def _root_cause(self, reason: str) -> str:
        """A worker that fails in a collective usually lost a peer: name the
        dead process first (give the kernel a moment to report it)."""
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            dead = [w for w in self.workers if not w.alive()]
            if dead:
                return "; ".join(w.describe_exit() for w in dead) + f"; then {reason[:300]}"
            time.sleep(0.05)
        return reason

    def check_alive(self) -> None:
        dead = [w for w in self.workers if not w.alive()]
        if dead:
            raise WorkerDied("; ".join(w.describe_exit() for w in dead))

    def shutdown(self) -> None:
        self._send_shutdown()
        # Workers stuck in a collective with a dead peer never read Shutdown: all get one deadline.
        processes.stop_all(self.workers, grace=5.0, terminate_now=any(not w.alive() for w in self.workers))
        self.ctx.destroy(linger=0)

    def _send_shutdown(self) -> None:
        try:
            self.steps.send(serial.encode(Shutdown("engine shutting down")), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass


def spawn_workers(config: FleetConfig, workers: list[WorkerPlan],
                  addresses: ReplicaAddresses) -> list[processes.ChildProcess]:
    """Start the planned workers of one replica; they report Ready to its executor."""
    return [processes.spawn("fleet.core.launch.worker_process", worker.name, worker_startup_info(config, worker, addresses))
            for worker in workers]


def worker_startup_info(config: FleetConfig, worker: WorkerPlan, addresses: ReplicaAddresses) -> WorkerStartupInfo:
    return WorkerStartupInfo(config, worker, addresses.handshake, addresses.steps, addresses.results, addresses.store)


def worker_name(parallel: ParallelConfig, rank: int) -> str:
    coord = coord_of(parallel, rank)
    return process_names.worker_name(coord.dp, coord.pp, coord.tp)


def _node_address(parallel: ParallelConfig) -> str:
    """This node's address for peers on other nodes: --master-addr on node 0."""
    return parallel.master_addr if parallel.node_rank == 0 else ipc.address_towards(parallel.master_addr)


def make_executor(config: FleetConfig, plan: EngineCorePlan, facts: StartupFacts) -> Executor:
    if plan.executor == "uni":
        return UniExecutor(config, plan)
    if plan.executor == "ray":
        from fleet.core.launch.ray_executor import RayExecutor  # ray is an optional dependency

        return RayExecutor(config, plan, facts)
    return MultiprocExecutor(config, plan, facts)
