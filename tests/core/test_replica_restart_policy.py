"""Which deaths a launch survives, and the restart budget and back-off
(core/launch/replica_restarts.py as pure logic: no process is started here; the
restarts themselves are tests/parallel/test_replica_restarts.py)."""
from __future__ import annotations

import pytest

from fleet.config.engine_args import EngineArgs
from fleet.core.launch import replica_restarts
from fleet.core.launch.node_plan import engine_core_plans
from fleet.core.launch.replica_restarts import ReplicaRestarts, RestartRefused


class DeadEngine:
    def __init__(self, name: str):
        self.name = name

    def describe_exit(self) -> str:
        return f"{self.name} (pid 1) died (signal SIGKILL)"

    def release(self) -> None:
        pass


def config_of(model_dir: str, **fields):
    return EngineArgs(model=model_dir, device="cpu", kv_cache_memory_bytes=2**21, **fields).create_config()


@pytest.mark.parametrize("fields, restarts", [
    ({"data_parallel_size": 2}, True),
    ({}, False),  # on-failure: no other replica serves meanwhile
    ({"replica_restart_policy": "always"}, True),
    ({"data_parallel_size": 2, "replica_restart_policy": "never"}, False),
    ({"data_parallel_size": 2, "distributed_executor_backend": "ray"}, True),
    ({"data_parallel_size": 2, "data_parallel_backend": "ray"}, True),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2, "nnodes": 2}, True),  # a replica on each node
    ({"tensor_parallel_size": 4, "nnodes": 2, "replica_restart_policy": "always"}, False),  # it spans them
])
def test_which_launches_restart_replicas(tiny_llama_dir, fields, restarts):
    assert config_of(tiny_llama_dir, **fields).parallel.restarts_replicas is restarts


def test_lock_step_moe_replicas_are_not_restarted(tiny_mixtral_dir):
    config = config_of(tiny_mixtral_dir, data_parallel_size=2, enable_expert_parallel=True)
    assert config.parallel.replicas_step_together and not config.parallel.restarts_replicas


def restarts_of(model_dir: str, **fields) -> ReplicaRestarts:
    config = config_of(model_dir, data_parallel_size=2, **fields)
    return ReplicaRestarts(config, engine_core_plans(config, [0, 1], [], None), facts=None)


def test_back_off_doubles_while_a_replica_keeps_dying(tiny_llama_dir, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(replica_restarts.time, "monotonic", lambda: now[0])
    restarts = restarts_of(tiny_llama_dir, max_replica_restarts=10)
    now[0] += replica_restarts.STABLE_AFTER_S  # it served a while: the first back-off
    delays = []
    for _ in range(7):
        restarts.replica_died(DeadEngine("fleet-engine-dp1"))
        delays.append(restarts.replicas["fleet-engine-dp1"].due - now[0])
    assert delays == [1, 2, 4, 8, 16, 30, 30]


def test_the_death_past_the_budget_ends_the_job_and_old_restarts_expire(tiny_llama_dir, monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(replica_restarts.time, "monotonic", lambda: now[0])
    restarts = restarts_of(tiny_llama_dir, max_replica_restarts=2)
    restarts.replica_died(DeadEngine("fleet-engine-dp0"))
    restarts.replica_died(DeadEngine("fleet-engine-dp1"))
    with pytest.raises(RestartRefused, match="--max-replica-restarts 2"):
        restarts.replica_died(DeadEngine("fleet-engine-dp1"))
    now[0] += replica_restarts.RESTART_WINDOW_S + 1
    restarts.replica_died(DeadEngine("fleet-engine-dp1"))  # ten minutes on, the budget is back
