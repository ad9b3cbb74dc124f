"""Building the launch plan of one node (core/launch/node_plan.py) from a resolved
FleetConfig: which processes it runs, with which ranks and addresses.
`fleet plan` prints it; the launcher executes it."""
from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from fleet.config.cpu_class import cpu_paths
from fleet.config.fleet import FleetConfig
from fleet.config.parallel import ParallelConfig
from fleet.core import ipc
from fleet.core.launch.memory import gguf_holding_summary, node_memory
from fleet.core.launch.node_plan import (
    APIServerPlan,
    ClientAddresses,
    CoordinatorAddresses,
    CoordinatorPlan,
    NodePlan,
    StoreLocation,
    engine_core_plans,
    replica_workers,
    world_store,
)
from fleet.core.launch.process_names import DP_COORDINATOR, api_server_name
from fleet.parallel.dims import (
    node_engine_ranks,
    parallel_groups,
    replicas_served_from_elsewhere,
    runs_api_servers,
    runs_dp_coordinator,
)


def is_single_launch(parallel: ParallelConfig) -> bool:
    """Whether this launch runs the whole job (else other launches join it)."""
    return parallel.nnodes == 1 and parallel.data_parallel_size_local == parallel.data_parallel_size


def engine_transport(parallel: ParallelConfig) -> str:
    """ipc:// when every engine of the job shares this node with its API servers, else tcp://."""
    if not engines_may_run_elsewhere(parallel):
        return "ipc"
    return f"tcp://{parallel.data_parallel_address}:{parallel.data_parallel_rpc_port}"


def engines_may_run_elsewhere(parallel: ParallelConfig) -> bool:
    """Whether some engine core of the job may run on another machine (other
    launches or nodes, or Ray actors placed anywhere): then its sockets are TCP."""
    return not is_single_launch(parallel) or parallel.data_parallel_backend == "ray"


def coordinator_addresses(parallel: ParallelConfig) -> CoordinatorAddresses:
    """Where the DP coordinator listens: fresh ipc:// paths when every engine
    runs beside it; else --data-parallel-address with
    --data-parallel-rpc-port (engine inputs) and the port after it (broadcast)."""
    if not engines_may_run_elsewhere(parallel):
        return CoordinatorAddresses(*(ipc.new_ipc_address(tag) for tag in ("coord-in", "coord-out", "coord-loads")))
    host, port = parallel.data_parallel_address, parallel.data_parallel_rpc_port
    return CoordinatorAddresses(f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}", ipc.new_ipc_address("coord-loads"))


def engines_use_coordinator(parallel: ParallelConfig) -> bool:
    """Engines report to the coordinator when it runs beside them, lock-step
    engines wherever they run, and every engine of an internal-LB job (its
    API servers balance over all of them)."""
    internal_dp = parallel.data_parallel_size > 1 and parallel.internal_lb
    return runs_dp_coordinator(parallel) or parallel.replicas_step_together or internal_dp


def api_server_addresses(parallel: ParallelConfig, count: int) -> list[ClientAddresses]:
    """Where node 0's API servers take requests from engines. ipc:// when
    every engine they serve is on this node (hybrid/external launches serve
    only their own); for an internal-LB job whose engines may run elsewhere,
    fixed TCP ports after the coordinator's two (--data-parallel-rpc-port
    + 2 + 2i and + 3 + 2i for API server i), which every node computes alike."""
    if not (engines_may_run_elsewhere(parallel) and parallel.internal_lb):
        return [ClientAddresses.new() for _ in range(count)]
    host, base = parallel.data_parallel_address, parallel.data_parallel_rpc_port + 2
    return [ClientAddresses(f"tcp://{host}:{base + 2 * i}", f"tcp://{host}:{base + 2 * i + 1}") for i in range(count)]


def engines_per_api_server(parallel: ParallelConfig) -> int:
    """Internal LB: every engine of the job; hybrid/external: this launch's own."""
    if parallel.internal_lb:
        return parallel.data_parallel_size
    return parallel.data_parallel_size_local


def build_node_plan(config: FleetConfig) -> NodePlan:
    """The one plan of this node: what `fleet plan` prints and the launcher starts."""
    parallel = config.parallel
    coordinator = _coordinator_plan(config) if runs_dp_coordinator(parallel) else None
    engines_coordinator = coordinator.addresses if coordinator is not None else None
    if coordinator is None and engines_use_coordinator(parallel):
        engines_coordinator = coordinator_addresses(parallel)  # on the launch of rank 0 (TCP): connect there
    clients = api_server_addresses(parallel, config.frontend.api_server_count)
    if parallel.headless and parallel.nnodes == 1:
        clients = []
    api_servers = []
    if runs_api_servers(parallel):
        url = f"http://{config.frontend.host}:{config.frontend.port}"
        load_address = coordinator.addresses.loads if coordinator is not None else None
        stores = [ipc.new_ipc_address(f"responses-{index}") for index in range(len(clients))]
        api_servers = [
            APIServerPlan(api_server_name(index), index, url, addresses, engines_per_api_server(parallel), load_address,
                          config.frontend.sandbox_processes, stores)
            for index, addresses in enumerate(clients)
        ]
    job_store = StoreLocation(parallel.master_addr, parallel.master_port, "launcher") if parallel.nnodes > 1 else None
    return NodePlan(
        node_rank=parallel.node_rank,
        api_servers=api_servers,
        dp_coordinator=coordinator,
        engine_cores=engine_core_plans(config, node_engine_ranks(parallel), clients, engines_coordinator),
        workers_of_remote_engines=[
            worker for dp_rank in replicas_served_from_elsewhere(parallel)
            for worker in replica_workers(config, dp_rank)
        ],
        job_store=job_store,
        engine_transport=engine_transport(parallel),
    )


def _coordinator_plan(config: FleetConfig) -> CoordinatorPlan:
    store = world_store(config)
    hosts_store = store is not None and store.hosted_by == "dp_coordinator"
    return CoordinatorPlan(DP_COORDINATOR, coordinator_addresses(config.parallel), store if hosts_store else None)


def describe(config: FleetConfig, plan: NodePlan) -> dict[str, Any]:
    """Everything `fleet plan` prints: the node's plan and the config it came from."""
    return {
        "node": msgspec.to_builtins(plan),
        "parallel": config.parallel.as_dict(),
        "groups": parallel_groups(config.parallel)._asdict(),
        "model": config.model.summary(),
        "scheduler": dataclasses.asdict(config.scheduler),
        "cache": dataclasses.asdict(config.cache),
        "memory": _memory_summary(config),
        "gguf_weights": gguf_holding_summary(config),
        "device": {**dataclasses.asdict(config.device), "distributed_backend": config.device.distributed_backend},
        "cpu": cpu_paths(config.model) if config.device.device == "cpu" else None,
        "load": dataclasses.asdict(config.load),
        "frontend": {k: v for k, v in dataclasses.asdict(config.frontend).items() if k != "api_key"},
        "compilation": dataclasses.asdict(config.compilation),
        "kv_transfer": _kv_transfer_summary(config),
    }


def _kv_transfer_summary(config: FleetConfig) -> dict[str, Any] | None:
    """--kv-transfer-config, and with --disaggregate which replicas prefill and which decode."""
    if config.kv_transfer is None:
        return None
    summary: dict[str, Any] = dataclasses.asdict(config.kv_transfer)
    extra = summary["kv_connector_extra_config"]
    if "secret" in extra:  # a plan is printed and logged: it says there is one, never what
        summary["kv_connector_extra_config"] = {**extra, "secret": "<set>"}
    if config.parallel.disaggregation is not None:
        prefill = config.parallel.prefill_ranks()
        summary["prefill_replicas"] = prefill
        summary["decode_replicas"] = [r for r in range(config.parallel.data_parallel_size) if r not in prefill]
    return summary


def _memory_summary(config: FleetConfig) -> dict[str, Any] | str:
    """The node's memory plan (CPU workers); on CUDA each worker profiles its device."""
    if config.device.device == "cuda":
        return "each worker profiles its GPU at start-up (--gpu-memory-utilization)"
    return node_memory(config).summary()
