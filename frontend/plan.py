"""The launch plan of one node: which processes it runs, with which ranks and
addresses. Pure data from a resolved FleetConfig; `fleet plan` prints it and
the launcher follows it."""
from __future__ import annotations

import dataclasses
from typing import Any

from fleet.config.fleet import FleetConfig
from fleet.config.parallel import ParallelConfig
from fleet.core import ipc
from fleet.core.dp_coordinator import CoordinatorAddresses
from fleet.core.process_names import DP_COORDINATOR, api_server_name, engine_core_name, worker_name
from fleet.frontend.engine_client import ClientAddresses
from fleet.parallel.dims import (
    coord_of,
    node_engine_ranks,
    node_worker_ranks,
    parallel_groups,
    runs_api_servers,
    runs_dp_coordinator,
)
from fleet.workers.memory import node_memory, planned_kv_cache_bytes


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


def node_processes(config: FleetConfig) -> list[dict[str, Any]]:
    parallel = config.parallel
    processes: list[dict[str, Any]] = []
    if runs_api_servers(parallel):
        url = f"http://{config.frontend.host}:{config.frontend.port}"
        for index in range(config.frontend.api_server_count):
            processes.append({"kind": "api_server", "name": api_server_name(index), "index": index, "url": url})
    if runs_dp_coordinator(parallel):
        processes.append({"kind": "dp_coordinator", "name": DP_COORDINATOR})
    for dp_rank in node_engine_ranks(parallel):
        first = dp_rank * parallel.replica_size
        processes.append(
            {
                "kind": "engine_core",
                "name": engine_core_name(dp_rank),
                "dp_rank": dp_rank,
                "workers": list(range(first, first + parallel.replica_size)),
                "executor": parallel.distributed_executor_backend,
            }
        )
    kv_cache_bytes = planned_kv_cache_bytes(config)
    for local_rank, rank in enumerate(node_worker_ranks(parallel)):
        coord = coord_of(parallel, rank)
        processes.append(
            {
                "kind": "worker",
                "name": worker_name(coord.dp, coord.pp, coord.tp),
                "rank": rank,
                "local_rank": local_rank,
                "dp_rank": coord.dp,
                "pp_rank": coord.pp,
                "tp_rank": coord.tp,
                "device": "cpu" if config.device.device == "cpu" else f"cuda:{local_rank}",
                "kv_cache_bytes": kv_cache_bytes if kv_cache_bytes is not None else "profiled at start-up",
            }
        )
    return processes


def node_plan(config: FleetConfig) -> dict[str, Any]:
    """Everything `fleet plan` prints: config facts, groups and processes."""
    parallel = config.parallel
    master_port = parallel.master_port if parallel.master_port is not None else "bound at start-up"
    return {
        "parallel": parallel.as_dict(),
        "groups": parallel_groups(parallel)._asdict(),
        "processes": node_processes(config),
        "addresses": {
            "engines": engine_transport(parallel),
            "dp_coordinator": _coordinator_summary(parallel),
            "api_servers": _api_server_summary(parallel, config.frontend.api_server_count),
            "job_store": f"tcp://{parallel.master_addr}:{parallel.master_port}" if parallel.nnodes > 1 else None,
            "torch_distributed": f"tcp://{parallel.master_addr}:{master_port}",
            "backend": config.device.distributed_backend,
        },
        "model": config.model.summary(),
        "scheduler": dataclasses.asdict(config.scheduler),
        "cache": dataclasses.asdict(config.cache),
        "memory": _memory_summary(config),
        "device": dataclasses.asdict(config.device),
        "load": dataclasses.asdict(config.load),
        "frontend": {k: v for k, v in dataclasses.asdict(config.frontend).items() if k != "api_key"},
        "compilation": dataclasses.asdict(config.compilation),
    }


def _memory_summary(config: FleetConfig) -> dict[str, Any] | str:
    """The node's memory plan (CPU workers); on CUDA each worker profiles its device."""
    if config.device.device == "cuda":
        return "each worker profiles its GPU at start-up (--gpu-memory-utilization)"
    return node_memory(config).summary()


def _coordinator_summary(parallel: ParallelConfig) -> str | None:
    if not engines_use_coordinator(parallel):
        return None
    addresses = coordinator_addresses(parallel)
    if addresses.engine_inputs.startswith("ipc://"):
        return "ipc"
    return f"{addresses.engine_inputs} (votes and loads), {addresses.engine_broadcast} (broadcast)"


def _api_server_summary(parallel: ParallelConfig, count: int) -> str | list[str]:
    """Where engines reach the API servers: ipc, or node 0's TCP ports for every node."""
    addresses = api_server_addresses(parallel, count)
    if all(a.requests.startswith("ipc://") for a in addresses):
        return "ipc"
    return [address for a in addresses for address in (a.requests, a.outputs)]
