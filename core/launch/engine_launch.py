"""Starting this node's engine cores, for the launcher and for fleet.LLM
alike: one child process per replica, or with --data-parallel-backend ray
one actor per replica, watched and stopped the same way; and, on a node of
a multi-node job, the workers of replicas whose engine core runs elsewhere."""
from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from fleet.config.fleet import FleetConfig
from fleet.core.launch import processes
from fleet.core.launch.engine_process import EngineCoreStartupInfo
from fleet.core.launch.node_plan import EngineCorePlan, StartupFacts, WorkerPlan

if TYPE_CHECKING:
    from fleet.core.launch.job_store import JobStore  # imports torch: multi-node launches only


def start_engine_cores(
    config: FleetConfig, plans: list[EngineCorePlan], handshake_address: str, facts: StartupFacts
) -> list[processes.ChildProcess]:
    """The engine cores of `plans` (this node's, one per local data-parallel
    rank); they report Ready to `handshake_address`."""
    started = []
    for plan in plans:
        info = EngineCoreStartupInfo(config, plan, handshake_address, facts)
        started.append(_start(config, plan.name, info))
    return started


def start_workers_of_remote_engines(
    config: FleetConfig, workers: list[WorkerPlan], job: JobStore | None
) -> list[processes.ChildProcess]:
    """Workers on this node of replicas whose engine core runs on another
    node: they report to that engine once it published its addresses in the
    job store (the engine's executor starts the others itself)."""
    from fleet.core.launch.executor import ReplicaAddresses, spawn_workers  # torch-free, but only multi-node needs it

    started = []
    for dp_rank in sorted({worker.dp_rank for worker in workers}):
        assert job is not None, "replicas served from elsewhere exist only in multi-node jobs"
        addresses = job.lookup(f"replica/{dp_rank}/executor", ReplicaAddresses)
        started.extend(spawn_workers(config, [w for w in workers if w.dp_rank == dp_rank], addresses))
    return started


def _start(config: FleetConfig, name: str, info: EngineCoreStartupInfo) -> processes.ChildProcess:
    if config.parallel.data_parallel_backend != "ray":
        return processes.spawn("fleet.core.launch.engine_process", name, info)
    from fleet.core.launch.ray_engine import start_engine_actor  # ray is an optional dependency

    return start_engine_actor(config, name, msgspec.msgpack.encode(info))
