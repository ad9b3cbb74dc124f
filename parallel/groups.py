"""torch.distributed initialisation of one worker, and its parallel groups.

Replicas that step independently each have their own world: the workers of
one replica join a process group (gloo on CPU, nccl on CUDA) through a
TCPStore that their executor hosts. When replicas step together (expert
parallel across data-parallel ranks) every worker of the job joins one
world through the TCPStore at --master-addr/--master-port, hosted by the DP
coordinator; a multi-node job's worlds all meet in node 0's job store. The
node plan decides which (core/launch/node_plan.py, world_store); all members create every group in the same order
(new_group is collective) and keep the ones they belong to.
"""
from __future__ import annotations

import dataclasses
from datetime import timedelta

import torch.distributed as dist

from fleet.config.fleet import FleetConfig
from fleet.parallel.comm import GroupCoordinator, set_dp_group, set_ep_group, set_pp_group, set_tp_group
from fleet.parallel.dims import parallel_groups


def init_worker_groups(config: FleetConfig, dp_rank: int, rank: int, store_host: str | None, store_port: int) -> None:
    """Join this worker's world, at the TCPStore on `store_host`:`store_port`
    (as the node plan placed it), as replica rank `rank` (pp * TP + tp) of
    data-parallel rank `dp_rank`, and set its TP, PP, EP and DP groups. A world
    of one worker (no store host) touches nothing."""
    if store_host is None:
        return
    parallel = config.parallel
    if parallel.replicas_step_together:
        layout, world_rank, world = parallel, dp_rank * parallel.replica_size + rank, "job"
    else:
        layout, world_rank, world = dataclasses.replace(parallel, data_parallel_size=1), rank, f"replica{dp_rank}"
    world_size = layout.world_size
    timeout = timedelta(seconds=parallel.distributed_timeout_seconds)
    client = dist.TCPStore(store_host, store_port, world_size=world_size, is_master=False, timeout=timeout)
    world_store = dist.PrefixStore(f"{world}/", client)  # a job store holds every world of the job
    dist.init_process_group(
        config.device.distributed_backend, store=world_store, rank=world_rank, world_size=world_size, timeout=timeout
    )
    groups = parallel_groups(layout)
    set_tp_group(_member_group(groups.tp, world_rank))
    set_pp_group(_member_group(groups.pp, world_rank))
    set_dp_group(_member_group(groups.dp, world_rank))
    set_ep_group(_member_group(groups.ep, world_rank))


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
