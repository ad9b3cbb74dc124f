"""Worker ranks and parallel groups as pure data: no torch, no processes.

Global worker rank = ((dp * PP) + pp) * TP + tp, so a tensor-parallel group
is consecutive ranks, a pipeline group strides TP, a data-parallel group
strides PP * TP, and an expert-parallel group is every DP x TP rank of one
pipeline stage.
"""
from __future__ import annotations

from typing import NamedTuple

from fleet.config.parallel import ParallelConfig


class WorkerCoord(NamedTuple):
    dp: int
    pp: int
    tp: int


class ParallelGroups(NamedTuple):
    tp: list[list[int]]
    pp: list[list[int]]
    dp: list[list[int]]
    ep: list[list[int]]
    """Empty when expert parallel is off."""


def global_rank(config: ParallelConfig, coord: WorkerCoord) -> int:
    return (coord.dp * config.pipeline_parallel_size + coord.pp) * config.tensor_parallel_size + coord.tp


def coord_of(config: ParallelConfig, rank: int) -> WorkerCoord:
    tp = rank % config.tensor_parallel_size
    pp = (rank // config.tensor_parallel_size) % config.pipeline_parallel_size
    dp = rank // config.replica_size
    return WorkerCoord(dp, pp, tp)


def driver_rank(config: ParallelConfig) -> int:
    """Rank within a replica of the worker that samples and answers the
    engine: tensor rank 0 of the last pipeline stage."""
    return (config.pipeline_parallel_size - 1) * config.tensor_parallel_size


def parallel_groups(config: ParallelConfig) -> ParallelGroups:
    dps, pps, tps = config.data_parallel_size, config.pipeline_parallel_size, config.tensor_parallel_size

    def rank(dp: int, pp: int, tp: int) -> int:
        return global_rank(config, WorkerCoord(dp, pp, tp))

    tp_groups = [[rank(d, p, t) for t in range(tps)] for d in range(dps) for p in range(pps)]
    pp_groups = [[rank(d, p, t) for p in range(pps)] for d in range(dps) for t in range(tps)]
    dp_groups = [[rank(d, p, t) for d in range(dps)] for p in range(pps) for t in range(tps)]
    ep_groups = (
        [sorted(rank(d, p, t) for d in range(dps) for t in range(tps)) for p in range(pps)]
        if config.enable_expert_parallel
        else []
    )
    return ParallelGroups(tp_groups, pp_groups, dp_groups, ep_groups)


def node_worker_ranks(config: ParallelConfig) -> range:
    """Global ranks of the workers this launch runs.

    With --nnodes, each node runs an equal slice of the world (a replica may
    span nodes); otherwise a launch runs the whole replicas of its local
    data-parallel ranks.
    """
    if config.nnodes > 1:
        start = config.node_rank * config.world_size_local
        return range(start, start + config.world_size_local)
    first_dp, local = config.data_parallel_rank or 0, config.data_parallel_size_local or config.data_parallel_size
    return range(first_dp * config.replica_size, (first_dp + local) * config.replica_size)


def node_engine_ranks(config: ParallelConfig) -> list[int]:
    """Data-parallel ranks whose engine core runs on this launch: those whose
    first worker (pp=0, tp=0) is one of this launch's workers."""
    workers = node_worker_ranks(config)
    first_dp = config.data_parallel_rank or 0
    local = config.data_parallel_size_local or config.data_parallel_size
    return [dp for dp in range(first_dp, first_dp + local) if dp * config.replica_size in workers]


def runs_api_servers(config: ParallelConfig) -> bool:
    return not config.headless


def runs_dp_coordinator(config: ParallelConfig) -> bool:
    """The coordinator runs beside data-parallel rank 0, when there are several ranks."""
    return config.data_parallel_size > 1 and 0 in node_engine_ranks(config)


def engine_node(config: ParallelConfig, dp_rank: int) -> int:
    """The node that runs replica `dp_rank`'s engine core: that of its first worker."""
    if config.nnodes == 1:
        return config.node_rank
    return dp_rank * config.replica_size // config.world_size_local


def replicas_served_from_elsewhere(config: ParallelConfig) -> list[int]:
    """Data-parallel ranks with workers on this node whose engine core runs on
    another node (a replica that spans nodes)."""
    here = sorted({coord_of(config, rank).dp for rank in node_worker_ranks(config)})
    return [dp for dp in here if engine_node(config, dp) != config.node_rank]


def replica_spans_nodes(config: ParallelConfig) -> bool:
    return config.nnodes > 1 and config.replica_size > config.world_size_local
