"""parallel/dims.py: ranks, coordinates and groups as pure data, and which
workers and engine cores each node of a layout runs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from fleet.config.parallel import ParallelConfig
from fleet.parallel.dims import (
    WorkerCoord,
    coord_of,
    global_rank,
    node_engine_ranks,
    node_worker_ranks,
    parallel_groups,
    replica_spans_nodes,
    replicas_served_from_elsewhere,
)


def resolved(is_moe: bool = False, **fields: Any) -> ParallelConfig:
    return ParallelConfig(**fields).resolve(is_moe=is_moe)


def _assert_partition(groups: list[list[int]], world_size: int) -> None:
    """Every rank of the world is in exactly one group."""
    ranks = sorted(itertools.chain.from_iterable(groups))
    assert ranks == list(range(world_size)), groups


LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 2), (4, 1, 2), (2, 3, 2), (1, 2, 3)]


def test_groups_for_tp2_pp2_dp2():
    groups = parallel_groups(ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2))
    assert groups.tp == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups.pp == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups.dp == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert groups.ep == []


def test_expert_parallel_groups_are_every_dp_and_tp_rank_of_a_stage():
    config = ParallelConfig(
        tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True
    )
    groups = parallel_groups(config)
    assert groups.ep == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert all(len(group) == config.expert_parallel_size for group in groups.ep)


def test_expert_parallel_groups_without_pipeline():
    config = ParallelConfig(tensor_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True)
    assert parallel_groups(config).ep == [[0, 1, 2, 3]]


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_each_kind_of_group_partitions_the_world(tp, pp, dp):
    config = ParallelConfig(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, enable_expert_parallel=True
    )
    groups = parallel_groups(config)
    for kind, size in (("tp", tp), ("pp", pp), ("dp", dp), ("ep", dp * tp)):
        members = getattr(groups, kind)
        _assert_partition(members, config.world_size)
        assert all(len(group) == size for group in members), (kind, members)
    assert all(group == list(range(group[0], group[0] + tp)) for group in groups.tp), "tp groups are consecutive"
    assert all(b - a == tp for group in groups.pp for a, b in itertools.pairwise(group)), "pp groups stride tp"
    assert all(b - a == tp * pp for group in groups.dp for a, b in itertools.pairwise(group)), "dp: stride pp x tp"


@pytest.mark.parametrize("tp,pp,dp", LAYOUTS)
def test_rank_and_coordinates_round_trip(tp, pp, dp):
    config = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    coords = [WorkerCoord(d, p, t) for d in range(dp) for p in range(pp) for t in range(tp)]
    ranks = [global_rank(config, coord) for coord in coords]
    assert ranks == list(range(config.world_size)), "ranks are dense and ordered dp, pp, tp"
    for coord, rank in zip(coords, ranks, strict=True):
        assert coord_of(config, rank) == coord
        assert rank == (coord.dp * pp + coord.pp) * tp + coord.tp


def test_coordinates_of_a_known_rank():
    config = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert coord_of(config, 6) == WorkerCoord(dp=1, pp=1, tp=0)
    assert global_rank(config, WorkerCoord(dp=0, pp=1, tp=1)) == 3


# ---------------------------------------------------------------- what each node runs


def test_one_node_runs_every_worker_and_engine():
    config = resolved(tensor_parallel_size=2, data_parallel_size=2)
    assert list(node_worker_ranks(config)) == [0, 1, 2, 3]
    assert node_engine_ranks(config) == [0, 1]


@pytest.mark.parametrize(
    "node_rank,workers,engines",
    [(0, [0, 1], [0]), (1, [2, 3], [])],
)
def test_tp4_over_two_nodes(node_rank, workers, engines):
    # One replica spans both nodes: node 1 runs workers only, no engine core.
    config = resolved(tensor_parallel_size=4, nnodes=2, node_rank=node_rank)
    assert list(node_worker_ranks(config)) == workers
    assert node_engine_ranks(config) == engines


@pytest.mark.parametrize(
    "node_rank,workers,engines",
    [(0, [0, 1], [0]), (1, [2, 3], []), (2, [4, 5], [1]), (3, [6, 7], [])],
)
def test_dp2_tp4_over_four_nodes(node_rank, workers, engines):
    config = resolved(tensor_parallel_size=4, data_parallel_size=2, nnodes=4, node_rank=node_rank)
    assert list(node_worker_ranks(config)) == workers
    assert node_engine_ranks(config) == engines


@pytest.mark.parametrize(
    "node_rank,workers,engines",
    [(0, [0, 1, 2, 3], [0, 1]), (1, [4, 5, 6, 7], [2, 3])],
)
def test_dp4_tp2_over_two_nodes(node_rank, workers, engines):
    config = resolved(tensor_parallel_size=2, data_parallel_size=4, nnodes=2, node_rank=node_rank)
    assert list(node_worker_ranks(config)) == workers
    assert node_engine_ranks(config) == engines


def test_pipeline_stages_over_two_nodes():
    # pp 2 x tp 2 = one replica of 4 workers over two nodes: stage 1 lives on node 1.
    node1 = resolved(tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2, node_rank=1)
    assert list(node_worker_ranks(node1)) == [2, 3]
    assert [coord_of(node1, rank).pp for rank in node_worker_ranks(node1)] == [1, 1]
    assert node_engine_ranks(node1) == []


def test_every_worker_and_engine_runs_on_exactly_one_node():
    fields = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2, "data_parallel_size": 4, "nnodes": 4}
    nodes = [resolved(node_rank=rank, **fields) for rank in range(4)]
    workers = sorted(itertools.chain.from_iterable(node_worker_ranks(node) for node in nodes))
    engines = sorted(itertools.chain.from_iterable(node_engine_ranks(node) for node in nodes))
    assert workers == list(range(16))
    assert engines == [0, 1, 2, 3]


def test_hybrid_node_runs_its_own_replicas():
    config = resolved(
        tensor_parallel_size=2, data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2
    )
    assert list(node_worker_ranks(config)) == [4, 5, 6, 7]
    assert node_engine_ranks(config) == [2, 3]


def test_external_launch_runs_one_replica():
    config = resolved(is_moe=True, tensor_parallel_size=2, data_parallel_size=4, data_parallel_rank=3)
    assert list(node_worker_ranks(config)) == [6, 7]
    assert node_engine_ranks(config) == [3]


@pytest.mark.parametrize(
    "fields,node_rank,engines,served_elsewhere",
    [
        (dict(data_parallel_size=2, tensor_parallel_size=2), 1, [1], []),  # a replica per node
        (dict(tensor_parallel_size=4), 0, [0], []),  # one replica over two nodes: its engine on node 0
        (dict(tensor_parallel_size=4), 1, [], [0]),
        (dict(pipeline_parallel_size=2), 1, [], [0]),
    ],
)
def test_engines_and_replicas_of_a_two_node_job(fields, node_rank, engines, served_elsewhere):
    config = ParallelConfig(nnodes=2, node_rank=node_rank, **fields).resolve(is_moe=False)
    assert node_engine_ranks(config) == engines
    assert replicas_served_from_elsewhere(config) == served_elsewhere
    assert replica_spans_nodes(config) == (config.replica_size > config.world_size_local)
