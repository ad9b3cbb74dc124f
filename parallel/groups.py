"""torch.distributed initialisation of one worker, and its parallel groups.

Every worker of a replica joins one process group (gloo on CPU, nccl on
CUDA) through a TCPStore that the executor hosts; then all of them create
every tensor- and pipeline-parallel group in the same order (new_group is
collective) and keep the ones they belong to.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch.distributed as dist

from fleet.config.fleet import FleetConfig
from fleet.parallel.comm import GroupCoordinator, set_pp_group, set_tp_group
from fleet.parallel.dims import parallel_groups


def init_worker_groups(config: FleetConfig, rank: int, store_host: str, store_port: int) -> None:
    """Join the replica's process group as `rank` (pp * TP + tp) and set this
    worker's TP and PP groups. A single-worker replica touches nothing."""
    parallel = config.parallel
    world_size = parallel.replica_size
    if world_size == 1:
        return
    timeout = timedelta(seconds=parallel.distributed_timeout_seconds)
    store = dist.TCPStore(store_host, store_port, world_size=world_size, is_master=False, timeout=timeout)
    dist.init_process_group(config.device.distributed_backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    replica = parallel_groups(dataclasses.replace(parallel, data_parallel_size=1, enable_expert_parallel=False))
    set_tp_group(_member_group(replica.tp, rank))
    set_pp_group(_member_group(replica.pp, rank))


def _member_group(all_groups: list[list[int]], rank: int) -> GroupCoordinator:
    mine = GroupCoordinator()
    for ranks in all_groups:
        group = dist.new_group(ranks)  # collective: every rank creates every group
        if rank in ranks:
            mine = GroupCoordinator(ranks.index(rank), len(ranks), group)
    return mine


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """Layers of one pipeline stage: an even split, the remainder to the first stages."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))
