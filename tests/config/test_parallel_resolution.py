"""ParallelConfig.resolve: vLLM's create_engine_config rules for nodes, data-parallel
ranks and load balancing, each with its positive and negative cases."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import pytest

from fleet.config.parallel import ParallelConfig


class Resolved(NamedTuple):
    """What resolution decides for one node."""

    data_parallel_rank: int
    data_parallel_size_local: int
    external: bool
    hybrid: bool
    headless: bool


def resolve(is_moe: bool = False, **fields: Any) -> ParallelConfig:
    return ParallelConfig(**fields).resolve(is_moe=is_moe)


def decided(config: ParallelConfig) -> Resolved:
    return Resolved(
        config.data_parallel_rank,
        config.data_parallel_size_local,
        config.data_parallel_external_lb,
        config.data_parallel_hybrid_lb,
        config.headless,
    )


def assert_error_names(error: pytest.ExceptionInfo[ValueError], *flags: str) -> None:
    message = str(error.value)
    missing = [flag for flag in flags if flag not in message]
    assert not missing, f"{missing} not named in {message!r}"


# ---------------------------------------------------------------- one node, internal LB


def test_defaults_are_one_replica_on_one_node():
    config = resolve()
    assert decided(config) == Resolved(0, 1, external=False, hybrid=False, headless=False)
    assert config.data_parallel_start_rank == 0
    assert config.data_parallel_address == config.master_addr == "127.0.0.1"
    assert config.is_moe is False
    assert (config.world_size, config.world_size_local, config.replica_size) == (1, 1, 1)


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 4), (2, 1, 2), (2, 2, 2), (4, 2, 1)])
def test_one_node_runs_every_replica(tp, pp, dp):
    config = resolve(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    assert decided(config) == Resolved(0, dp, external=False, hybrid=False, headless=False)
    assert config.world_size == config.world_size_local == tp * pp * dp
    assert config.replica_size == tp * pp


def test_is_moe_is_recorded():
    assert resolve(is_moe=True).is_moe is True


def test_data_parallel_address_defaults_to_master_addr_and_can_be_set():
    assert resolve(master_addr="10.0.0.1").data_parallel_address == "10.0.0.1"
    config = resolve(master_addr="10.0.0.1", data_parallel_address="10.0.0.2")
    assert config.data_parallel_address == "10.0.0.2"


def test_resolution_returns_a_new_config():
    config = ParallelConfig(data_parallel_size=2)
    resolved = config.resolve(is_moe=False)
    assert resolved is not config
    assert config.data_parallel_size_local is None and config.data_parallel_rank is None


# ---------------------------------------------------------------- several nodes, internal LB


@pytest.mark.parametrize(
    "tp,pp,dp,nnodes,node_rank,expected",
    [
        # world 4 over 2 nodes, one-worker replicas: two replicas a node.
        (1, 1, 4, 2, 0, Resolved(0, 2, False, False, headless=False)),
        (1, 1, 4, 2, 1, Resolved(2, 2, False, False, headless=True)),
        # world 8 over 2 nodes, replicas of tp 2 x pp 2: one replica a node.
        (2, 2, 2, 2, 0, Resolved(0, 1, False, False, headless=False)),
        (2, 2, 2, 2, 1, Resolved(1, 1, False, False, headless=True)),
        # world 8 over 2 nodes, replicas of tp 2: two replicas a node.
        (2, 1, 4, 2, 1, Resolved(2, 2, False, False, headless=True)),
        # a replica of tp 4 spans two nodes: local size is at least 1.
        (4, 1, 1, 2, 0, Resolved(0, 1, False, False, headless=False)),
        (4, 1, 1, 2, 1, Resolved(0, 1, False, False, headless=True)),
        # world 8 over 4 nodes, replicas of tp 4: two nodes a replica.
        (4, 1, 2, 4, 1, Resolved(0, 1, False, False, headless=True)),
        (4, 1, 2, 4, 2, Resolved(1, 1, False, False, headless=True)),
        (4, 1, 2, 4, 3, Resolved(1, 1, False, False, headless=True)),
        # pipeline stages only: world 6 over 3 nodes.
        (1, 2, 3, 3, 2, Resolved(2, 1, False, False, headless=True)),
    ],
)
def test_nodes_infer_their_data_parallel_rank_and_local_size(tp, pp, dp, nnodes, node_rank, expected):
    config = resolve(
        tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, nnodes=nnodes, node_rank=node_rank
    )
    assert decided(config) == expected
    assert config.data_parallel_start_rank == expected.data_parallel_rank
    assert config.world_size_local == tp * pp * dp // nnodes


def test_explicit_local_size_wins_over_the_inferred_one():
    config = resolve(data_parallel_size=4, nnodes=2, node_rank=1, data_parallel_size_local=1)
    assert decided(config) == Resolved(2, 1, external=False, hybrid=False, headless=True)


def test_node_zero_of_internal_lb_serves_http():
    assert resolve(data_parallel_size=2, nnodes=2, node_rank=0).headless is False


def test_headless_node_with_start_rank_stays_internal():
    # A headless node may name its first rank; that alone does not make it hybrid.
    config = resolve(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, headless=True)
    assert decided(config) == Resolved(2, 2, external=False, hybrid=False, headless=True)


# ---------------------------------------------------------------- hybrid LB


def test_start_rank_with_local_size_selects_hybrid():
    config = resolve(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2)
    assert decided(config) == Resolved(2, 2, external=False, hybrid=True, headless=False)
    assert config.data_parallel_start_rank == 2


def test_hybrid_node_rank_one_is_not_made_headless():
    config = resolve(
        data_parallel_size=4, nnodes=2, node_rank=1, data_parallel_size_local=2, data_parallel_start_rank=2
    )
    assert decided(config) == Resolved(2, 2, external=False, hybrid=True, headless=False)


def test_hybrid_flag_on_node_zero():
    # start rank 0 is falsy, so node 0 of a hybrid job asks for it by flag.
    config = resolve(data_parallel_size=4, data_parallel_size_local=2, data_parallel_hybrid_lb=True)
    assert decided(config) == Resolved(0, 2, external=False, hybrid=True, headless=False)


def test_start_rank_zero_with_local_size_is_internal_unless_hybrid_is_asked():
    """As vLLM: only a start rank above 0 implies hybrid; the first launch passes --data-parallel-hybrid-lb."""
    config = resolve(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=0)
    assert decided(config) == Resolved(0, 2, external=False, hybrid=False, headless=False)
    config = resolve(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=0,
                     data_parallel_hybrid_lb=True)
    assert decided(config) == Resolved(0, 2, external=False, hybrid=True, headless=False)


def test_local_size_without_start_rank_is_internal():
    config = resolve(data_parallel_size=4, data_parallel_size_local=2)
    assert decided(config) == Resolved(0, 2, external=False, hybrid=False, headless=False)


def test_hybrid_with_local_size_one_becomes_external(caplog):
    with caplog.at_level(logging.WARNING, logger="fleet.config.parallel"):
        config = resolve(data_parallel_size=4, data_parallel_size_local=1, data_parallel_start_rank=3)
    assert decided(config) == Resolved(3, 1, external=True, hybrid=False, headless=False)
    assert "external" in caplog.text


def test_hybrid_flag_with_local_size_one_becomes_external():
    config = resolve(data_parallel_size=2, data_parallel_size_local=1, data_parallel_hybrid_lb=True)
    assert decided(config) == Resolved(0, 1, external=True, hybrid=False, headless=False)


def test_local_size_equal_to_data_parallel_size_is_not_hybrid():
    config = resolve(data_parallel_size=2, data_parallel_size_local=2, data_parallel_hybrid_lb=True)
    assert decided(config) == Resolved(0, 2, external=False, hybrid=False, headless=False)


def test_hybrid_without_local_size_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(data_parallel_size=4, data_parallel_hybrid_lb=True)
    assert_error_names(error, "--data-parallel-hybrid-lb", "--data-parallel-size-local")


def test_hybrid_and_external_together_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(
            is_moe=True,
            data_parallel_size=4,
            data_parallel_size_local=2,
            data_parallel_hybrid_lb=True,
            data_parallel_external_lb=True,
        )
    assert_error_names(error, "--data-parallel-hybrid-lb", "--data-parallel-external-lb")


def test_hybrid_with_headless_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(data_parallel_size=4, data_parallel_size_local=2, data_parallel_hybrid_lb=True, headless=True)
    assert_error_names(error, "--data-parallel-hybrid-lb", "--headless")


# ---------------------------------------------------------------- external LB


def test_data_parallel_rank_selects_external_lb():
    config = resolve(is_moe=True, data_parallel_size=4, data_parallel_rank=2)
    assert decided(config) == Resolved(2, 1, external=True, hybrid=False, headless=False)
    assert config.data_parallel_start_rank == 2


def test_external_lb_accepts_local_size_one():
    config = resolve(is_moe=True, data_parallel_size=4, data_parallel_rank=3, data_parallel_size_local=1)
    assert decided(config) == Resolved(3, 1, external=True, hybrid=False, headless=False)


def test_external_lb_flag_alone_on_one_node_is_an_error():
    """vLLM refuses it too: the launch cannot know which replica it is (fleet once took rank 0)."""
    with pytest.raises(ValueError) as error:
        resolve(is_moe=True, data_parallel_size=2, data_parallel_external_lb=True)
    assert_error_names(error, "--data-parallel-external-lb", "--data-parallel-rank", "--node-rank")


@pytest.mark.parametrize("node_rank,expected_rank", [(0, 0), (1, 1), (2, 2), (3, 3)])
def test_external_lb_over_nodes_infers_rank_from_node_rank(node_rank, expected_rank):
    config = resolve(is_moe=True, data_parallel_size=4, nnodes=4, node_rank=node_rank, data_parallel_external_lb=True)
    assert decided(config) == Resolved(expected_rank, 1, external=True, hybrid=False, headless=False)


def test_external_lb_over_nodes_with_tp_infers_rank():
    # world 8 over 4 nodes, replicas of tp 2: node 3 runs replica 3.
    config = resolve(
        is_moe=True, tensor_parallel_size=2, data_parallel_size=4, nnodes=4, node_rank=3, data_parallel_external_lb=True
    )
    assert decided(config) == Resolved(3, 1, external=True, hybrid=False, headless=False)


def test_external_lb_with_local_size_two_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(is_moe=True, data_parallel_size=4, data_parallel_rank=0, data_parallel_size_local=2)
    assert_error_names(error, "--data-parallel-size-local", "--data-parallel-rank")


def test_external_lb_flag_with_local_size_two_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(is_moe=True, data_parallel_size=4, data_parallel_external_lb=True, data_parallel_size_local=2)
    assert_error_names(error, "--data-parallel-size-local", "--data-parallel-external-lb")


@pytest.mark.parametrize(
    "fields",
    [
        {"data_parallel_rank": 1},
        {"data_parallel_external_lb": True},
        {"data_parallel_external_lb": True, "nnodes": 2, "node_rank": 1},
    ],
)
def test_external_lb_for_a_dense_model_with_data_parallel_is_an_error(fields):
    with pytest.raises(ValueError) as error:
        resolve(is_moe=False, data_parallel_size=2, **fields)
    assert_error_names(error, "--data-parallel-rank", "--data-parallel-external-lb", "--data-parallel-size")


def test_data_parallel_rank_for_a_dense_model_without_data_parallel_is_fine():
    config = resolve(is_moe=False, data_parallel_rank=0)
    assert decided(config) == Resolved(0, 1, external=True, hybrid=False, headless=False)


# ---------------------------------------------------------------- sizes and ranks


def test_nnodes_with_ray_data_parallel_backend_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(data_parallel_size=2, nnodes=2, data_parallel_backend="ray")
    assert_error_names(error, "--nnodes", "--data-parallel-backend")


def test_ray_data_parallel_backend_on_one_node_is_fine():
    assert resolve(data_parallel_size=2, data_parallel_backend="ray").data_parallel_backend == "ray"


@pytest.mark.parametrize("tp,pp,dp,nnodes", [(1, 1, 3, 2), (2, 1, 1, 4), (3, 1, 2, 4), (1, 3, 1, 2)])
def test_world_size_not_divisible_by_nnodes_is_an_error(tp, pp, dp, nnodes):
    with pytest.raises(ValueError) as error:
        resolve(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp, nnodes=nnodes)
    flags = ("--nnodes", "--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size")
    assert_error_names(error, *flags, f"world size {tp * pp * dp}")


@pytest.mark.parametrize("nnodes,node_rank", [(2, 2), (2, 5), (1, 1), (2, -1)])
def test_node_rank_outside_nnodes_is_an_error(nnodes, node_rank):
    with pytest.raises(ValueError) as error:
        resolve(data_parallel_size=2, nnodes=nnodes, node_rank=node_rank)
    assert_error_names(error, "--node-rank", "--nnodes")


@pytest.mark.parametrize(
    "flag,field",
    [
        ("--tensor-parallel-size", "tensor_parallel_size"),
        ("--pipeline-parallel-size", "pipeline_parallel_size"),
        ("--data-parallel-size", "data_parallel_size"),
        ("--nnodes", "nnodes"),
    ],
)
def test_sizes_below_one_are_an_error(flag, field):
    with pytest.raises(ValueError) as error:
        resolve(**{field: 0})
    assert_error_names(error, flag)


def test_uni_executor_with_several_workers_a_replica_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(tensor_parallel_size=2, distributed_executor_backend="uni")
    assert_error_names(error, "--distributed-executor-backend", "--tensor-parallel-size")
    assert resolve(data_parallel_size=2, distributed_executor_backend="uni").distributed_executor_backend == "uni"


def test_local_size_above_data_parallel_size_is_an_error():
    with pytest.raises(ValueError) as error:
        resolve(data_parallel_size=2, data_parallel_size_local=3)
    assert_error_names(error, "--data-parallel-size-local", "--data-parallel-size")


def test_ranks_past_data_parallel_size_are_an_error():
    with pytest.raises(ValueError) as error:
        resolve(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=3)
    assert_error_names(error, "--data-parallel-start-rank", "--data-parallel-size-local", "--data-parallel-size")
    with pytest.raises(ValueError) as error:
        resolve(is_moe=True, data_parallel_size=4, data_parallel_rank=4)
    assert_error_names(error, "--data-parallel-rank", "--data-parallel-size")


# ---------------------------------------------------------------- derived sizes


def test_expert_parallel_size_is_dp_times_tp_when_on():
    config = resolve(is_moe=True, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    assert config.expert_parallel_size == 1
    config = resolve(
        is_moe=True, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2, enable_expert_parallel=True
    )
    assert config.expert_parallel_size == 4


def test_as_dict_holds_every_field_and_the_derived_sizes():
    config = resolve(tensor_parallel_size=2, data_parallel_size=4, nnodes=2, node_rank=1)
    data = config.as_dict()
    for name in (
        "data_parallel_rank",
        "data_parallel_size_local",
        "data_parallel_external_lb",
        "data_parallel_hybrid_lb",
        "nnodes",
        "node_rank",
        "headless",
        "is_moe",
    ):
        assert data[name] == getattr(config, name)
    assert (data["world_size"], data["world_size_local"], data["replica_size"], data["expert_parallel_size"]) == (
        8,
        4,
        2,
        1,
    )


def test_replicas_step_together_only_for_expert_parallel_moe_over_several_replicas():
    assert resolve(is_moe=True, data_parallel_size=2, enable_expert_parallel=True).replicas_step_together
    assert not resolve(is_moe=True, data_parallel_size=2).replicas_step_together, "experts sliced within each replica"
    assert not resolve(is_moe=True, tensor_parallel_size=2, enable_expert_parallel=True).replicas_step_together
    assert not resolve(is_moe=False, data_parallel_size=2, enable_expert_parallel=True).replicas_step_together


@pytest.mark.parametrize(
    "fields",
    [
        dict(data_parallel_size=2, data_parallel_rank=1),
        dict(data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2),
        dict(data_parallel_size=2, nnodes=2, node_rank=1),
    ],
)
def test_a_job_of_several_launches_agrees_on_a_fixed_master_port(fields):
    assert resolve(is_moe=True, **fields).master_port == 29501
    assert resolve(is_moe=True, master_port=1234, **fields).master_port == 1234


def test_a_single_launch_binds_any_free_master_port():
    assert resolve(is_moe=True, data_parallel_size=2, enable_expert_parallel=True).master_port is None


