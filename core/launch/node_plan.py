"""The launch plan of one node as typed data: every process the node starts,
who starts it, its name, ranks, device, addresses and memory budget, and
where each torch.distributed world meets.

It is built once from the resolved config (core/launch/plan.py for `fleet
launch` and `fleet plan`; `engine_core_plans` also for fleet.LLM), printed
by `fleet plan` and executed by the launcher; each child receives its own
part in its startup info and decides nothing about the layout itself.

What only start-up can tell (the Ray cluster's address, a store port bound
to port 0) travels in StartupFacts, never written back into the config.
This module imports no torch.
"""
from __future__ import annotations

import msgspec

from fleet.config.fleet import FleetConfig
from fleet.core import ipc
from fleet.core.launch.memory import planned_kv_cache_bytes
from fleet.core.launch.process_names import engine_core_name, worker_name
from fleet.parallel.dims import coord_of, node_worker_ranks


class ClientAddresses(msgspec.Struct):
    """Where one client (API server or LLM) takes requests from engines' point of view."""

    requests: str
    """The client's ROUTER: engines connect a DEALER here."""
    outputs: str
    """The client's PULL: engines connect a PUSH here."""

    @staticmethod
    def new() -> ClientAddresses:
        return ClientAddresses(ipc.new_ipc_address("requests"), ipc.new_ipc_address("outputs"))


class CoordinatorAddresses(msgspec.Struct):
    engine_inputs: str
    """PULL: engines push their votes and loads here."""
    engine_broadcast: str
    """PUB: wake-ups and step decisions to every engine."""
    loads: str
    """PUB: the load table to the API servers of the coordinator's node."""


class StoreLocation(msgspec.Struct, frozen=True):
    """The torch TCPStore where the workers of one world meet."""

    host: str
    port: int
    """0: its host binds a free port at start-up and tells those who join."""
    hosted_by: str
    """"executor": each replica of several workers is its own world, in a store
    its executor hosts. "dp_coordinator": replicas that step together form one
    world, in the coordinator's store. "launcher": node 0's job store of a
    multi-node job holds every world, each under its own prefix."""


class WorkerPlan(msgspec.Struct):
    name: str
    dp_rank: int
    rank: int
    """Global rank: ((dp * PP) + pp) * TP + tp."""
    replica_rank: int
    """Rank within the replica: pp * TP + tp."""
    pp_rank: int
    tp_rank: int
    local_rank: int
    """Which of this node's devices (CUDA); 0 for a worker Ray places (it sees only its own GPU)."""
    num_local_workers: int
    """Workers sharing this node's devices and CPU cores."""
    device: str
    kv_cache_bytes: int | None
    """From the node's memory plan (or --kv-cache-memory-bytes); None: profiled on the GPU at start-up."""


class EngineCorePlan(msgspec.Struct):
    name: str
    dp_rank: int
    executor: str
    worker_ranks: list[int]
    """Global ranks of the replica's workers, on this node or not."""
    workers: list[WorkerPlan]
    """The workers its executor starts: this node's workers of the replica (all of them with Ray, which places them)."""
    store: StoreLocation | None
    """Where the replica's workers meet; None for a world of one worker."""
    clients: list[ClientAddresses]
    """One per API server (or the LLM): requests come from there, outputs go there."""
    coordinator: CoordinatorAddresses | None
    """The DP coordinator: loads go there, and lock-step votes."""


class APIServerPlan(msgspec.Struct):
    name: str
    index: int
    url: str
    addresses: ClientAddresses
    num_engines: int
    """The engines it balances: every replica (internal LB) or its launch's own."""
    load_address: str | None
    """The DP coordinator's load table, when the coordinator runs on this node."""
    sandbox_processes: int
    """Its children that render chat templates and check grammars
    (frontend/sandbox.py), named by core.process_names.sandbox_name."""
    response_store_addresses: list[str]
    """Where each API server of this launch answers for its stored responses
    (frontend/response_peers.py), this one's at `index`."""


class CoordinatorPlan(msgspec.Struct):
    name: str
    addresses: CoordinatorAddresses
    store: StoreLocation | None
    """The lock-step workers' store it hosts, if any."""


class NodePlan(msgspec.Struct):
    """Everything one launch starts; the launcher starts the first four kinds,
    each engine core's executor its own workers."""

    node_rank: int
    api_servers: list[APIServerPlan]
    dp_coordinator: CoordinatorPlan | None
    engine_cores: list[EngineCorePlan]
    workers_of_remote_engines: list[WorkerPlan]
    """This node's workers of replicas whose engine core runs on another node;
    they reach it through the addresses it publishes in the job store."""
    job_store: StoreLocation | None
    """Node 0's job store of a multi-node job, hosted by node 0's launcher."""
    engine_transport: str
    """ipc when every engine shares this node with its clients, else TCP."""


class StartupFacts(msgspec.Struct):
    """What the launch learned at start-up that no plan could say."""

    ray_address: str | None = None
    """The Ray cluster the launcher joined or started: engines and workers join the same."""
    store_port: int = 0
    """The port the DP coordinator's store bound, when the plan left it to start-up."""

    def resolve(self, store: StoreLocation | None) -> StoreLocation | None:
        """`store` with the bound port filled in where the plan left it open."""
        if store is None or store.port or store.hosted_by != "dp_coordinator":
            return store
        return msgspec.structs.replace(store, port=self.store_port)


def world_store(config: FleetConfig) -> StoreLocation | None:
    """Where the workers of each replica meet (see StoreLocation.hosted_by)."""
    parallel = config.parallel
    world_size = parallel.world_size if parallel.replicas_step_together else parallel.replica_size
    if world_size == 1:
        return None
    if parallel.nnodes > 1:
        return StoreLocation(parallel.master_addr, parallel.master_port, "launcher")
    if parallel.replicas_step_together:
        return StoreLocation(parallel.master_addr, parallel.master_port or 0, "dp_coordinator")
    # Independent replicas each host a store: only a lone replica may take the fixed port.
    port = parallel.master_port or 0 if parallel.data_parallel_size == 1 else 0
    return StoreLocation(parallel.master_addr, port, "executor")


def engine_core_plans(
    config: FleetConfig,
    dp_ranks: list[int],
    clients: list[ClientAddresses],
    coordinator: CoordinatorAddresses | None,
) -> list[EngineCorePlan]:
    """The engine cores of `dp_ranks`, each reaching `clients` (and the coordinator)."""
    parallel = config.parallel
    return [
        EngineCorePlan(
            name=engine_core_name(dp_rank),
            dp_rank=dp_rank,
            executor=parallel.distributed_executor_backend,
            worker_ranks=list(_replica_ranks(config, dp_rank)),
            workers=replica_workers(config, dp_rank),
            store=world_store(config),
            clients=clients,
            coordinator=coordinator,
        )
        for dp_rank in dp_ranks
    ]


def replica_workers(config: FleetConfig, dp_rank: int) -> list[WorkerPlan]:
    """The workers of replica `dp_rank` that this node starts; with the Ray
    executor every worker of the replica, on whichever node Ray places it."""
    kv_cache_bytes = planned_kv_cache_bytes(config)  # reads the node's memory: once, not per worker
    if config.parallel.distributed_executor_backend == "ray":  # Ray shows each actor only its own GPU
        return [_worker(config, rank, 0, 1, kv_cache_bytes) for rank in _replica_ranks(config, dp_rank)]
    node_ranks = node_worker_ranks(config.parallel)
    return [_worker(config, rank, rank - node_ranks.start, len(node_ranks), kv_cache_bytes)
            for rank in _replica_ranks(config, dp_rank) if rank in node_ranks]


def _replica_ranks(config: FleetConfig, dp_rank: int) -> range:
    size = config.parallel.replica_size
    return range(dp_rank * size, (dp_rank + 1) * size)


def _worker(config: FleetConfig, rank: int, local_rank: int, num_local_workers: int,
            kv_cache_bytes: int | None) -> WorkerPlan:
    coord = coord_of(config.parallel, rank)
    return WorkerPlan(
        name=worker_name(coord.dp, coord.pp, coord.tp),
        dp_rank=coord.dp,
        rank=rank,
        replica_rank=rank - coord.dp * config.parallel.replica_size,
        pp_rank=coord.pp,
        tp_rank=coord.tp,
        local_rank=local_rank,
        num_local_workers=num_local_workers,
        device="cpu" if config.device.device == "cpu" else f"cuda:{local_rank}",
        kv_cache_bytes=kv_cache_bytes,
    )
