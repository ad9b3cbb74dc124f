"""The worker process: `python -m fleet.core.launch.worker_process`, started by
the `mp` executor (a Ray worker actor runs `serve_worker` too). It builds the
`Worker` (workers/worker.py) from its plan, receives each SchedulerOutput on the
engine's broadcast socket and, if it is the driver, returns the runner output."""
from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING

import msgspec
import psutil
import zmq

from fleet.config import env
from fleet.config.fleet import FleetConfig
from fleet.core import ipc, serial
from fleet.core.launch import processes
from fleet.core.launch.node_plan import StoreLocation, WorkerPlan
from fleet.core.messages import (
    KVCapacity,
    Ready,
    SchedulerOutput,
    Shutdown,
    WorkerDead,
    WorkerInput,
    WorkerUtilityCall,
    WorkerUtilityResult,
)

if TYPE_CHECKING:
    from fleet.workers.worker import Worker

logger = logging.getLogger(__name__)


class WorkerStartupInfo(msgspec.Struct):
    """What a worker process (or Ray worker actor) receives on start-up."""

    config: FleetConfig
    plan: WorkerPlan
    handshake_address: str
    step_address: str
    """The engine's broadcast (XPUB) socket."""
    result_address: str
    """The engine's PULL socket; only the driver sends on it."""
    store: StoreLocation | None
    """Where the workers of its world meet, its port known; None: a world of one."""


def build_worker(config: FleetConfig, plan: WorkerPlan, store: StoreLocation | None) -> Worker:
    """The worker its plan describes, joined to its world at `store` (None: a world of one)."""
    from fleet.workers.worker import Worker  # torch: the executor that imports this module runs without it

    if store is not None and store.hosted_by == "launcher":  # a multi-node job: the store is node 0's
        _pin_gloo_to_the_route_to(store.host)
    return Worker(config, dp_rank=plan.dp_rank, replica_rank=plan.replica_rank, device=plan.device,
                  num_local_workers=plan.num_local_workers, kv_cache_bytes=plan.kv_cache_bytes,
                  store=None if store is None else (store.host, store.port), shows_progress=plan.rank == 0)


def _pin_gloo_to_the_route_to(host: str) -> None:
    """Gloo picks its interface from the hostname, which may not be the one
    the other nodes reach: use the interface that routes to node 0, unless
    the user chose one (GLOO_SOCKET_IFNAME)."""
    if env.gloo_interface():
        return
    address = ipc.address_towards(host)
    for interface, addresses in psutil.net_if_addrs().items():
        if any(a.address == address for a in addresses):
            env.set_gloo_interface(interface)
            return



def serve_worker(name: str, info: WorkerStartupInfo) -> None:
    """Build the worker, report Ready (or the error) to the executor, then
    serve scheduler outputs until Shutdown. A worker process's whole life, and a
    Ray worker actor's."""
    ctx = zmq.Context()

    def build() -> tuple[Worker, zmq.Socket, zmq.Socket | None, KVCapacity]:
        worker = build_worker(info.config, info.plan, info.store)
        steps = ipc.make_socket(ctx, zmq.SUB, connect=info.step_address)
        steps.setsockopt(zmq.SUBSCRIBE, b"")
        results = ipc.make_socket(ctx, zmq.PUSH, connect=info.result_address) if worker.is_driver else None
        return worker, steps, results, KVCapacity(worker.available_kv_blocks(), info.config.cache.block_size)

    worker, steps, results, capacity = processes.start_or_report(name, info.handshake_address, build)
    kv_export = worker.runner.kv_transfer.address if worker.runner.kv_transfer else None
    addresses = {"kv_export": kv_export} if kv_export else {}
    processes.report(info.handshake_address, Ready(name, os.getpid(), kv_capacity=capacity, addresses=addresses))
    _serve(worker, info.plan.replica_rank, name, steps, results)


def _serve(worker: Worker, rank: int, name: str, steps: zmq.Socket, results: zmq.Socket | None) -> None:
    decoder = serial.Decoder(WorkerInput, f"{name} steps")
    while True:
        message = decoder.decode(steps.recv())
        try:
            match message:
                case SchedulerOutput():
                    output = worker.execute(message)
                    if results is not None and output is not None:
                        results.send(serial.encode(output))
                case WorkerUtilityCall(call_id=call_id, method=method, args=args):
                    result = worker.utility(method, args)
                    if results is not None:
                        results.send(serial.encode(WorkerUtilityResult(call_id, result)))
                case Shutdown():
                    return
        except Exception as error:
            logger.exception("%s failed", name)
            if results is not None:
                results.send(serial.encode(WorkerDead(rank, f"{name}: {type(error).__name__}: {error}")))
            traceback.print_exc()
            sys.exit(1)


def main() -> None:
    processes.child_main(WorkerStartupInfo, serve_worker)


if __name__ == "__main__":
    main()
