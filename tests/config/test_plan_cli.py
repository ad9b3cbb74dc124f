"""`fleet plan`: the resolved launch plan of one node, as JSON. A few cases run
the real command in a subprocess; the rest build and describe the plan directly."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest

import fleet as fleet_package
from fleet.config import EngineArgs
from fleet.core.launch.plan import build_node_plan, describe
from fleet.frontend.cli import main
from fleet.tests.config.plan_json import kinds, of_kind, planned_processes

PLAN_KEYS = {"node", "parallel", "groups", "scheduler", "cache", "model"}


def fleet(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleet.frontend.cli", *argv], capture_output=True, text=True, timeout=120
    )


def plan_of(model, **fields: Any) -> dict[str, Any]:
    config = EngineArgs(model=str(model), device=fields.pop("device", "cpu"), **fields).create_config()
    plan = describe(config, build_node_plan(config))
    assert json.loads(json.dumps(plan)) == plan, "the plan is plain JSON data"
    return plan


def engine_plan(plan: dict[str, Any], index: int = 0) -> dict[str, Any]:
    return plan["node"]["engine_cores"][index]


# ---------------------------------------------------------------- through a real subprocess


def test_plan_subprocess_tp2_dp2(llama_config_dir):
    result = fleet("plan", str(llama_config_dir), "--tp", "2", "--dp", "2", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert PLAN_KEYS <= plan.keys()
    assert kinds(plan) == {"api_server": 1, "dp_coordinator": 1, "engine_core": 2, "worker": 4, "sandbox": 2}
    assert [e["worker_ranks"] for e in of_kind(plan, "engine_core")] == [[0, 1], [2, 3]]
    workers = of_kind(plan, "worker")
    assert [(w["rank"], w["dp_rank"], w["pp_rank"], w["tp_rank"]) for w in workers] == [
        (0, 0, 0, 0),
        (1, 0, 0, 1),
        (2, 1, 0, 0),
        (3, 1, 0, 1),
    ]
    assert all(w["device"] == "cpu" for w in workers)
    assert plan["groups"] == {"tp": [[0, 1], [2, 3]], "pp": [[0], [1], [2], [3]], "dp": [[0, 2], [1, 3]], "ep": []}
    parallel = plan["parallel"]
    for key, value in {
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "data_parallel_rank": 0,
        "data_parallel_size_local": 2,
        "data_parallel_external_lb": False,
        "data_parallel_hybrid_lb": False,
        "world_size": 4,
        "nnodes": 1,
        "node_rank": 0,
    }.items():
        assert parallel[key] == value, key
    assert plan["model"]["architecture"] == "LlamaForCausalLM" and "hf_config" not in plan["model"]
    assert plan["scheduler"]["max_num_batched_tokens"] == 2048
    assert plan["cache"]["enable_prefix_caching"] is True


def test_plan_subprocess_headless_node(llama_config_dir):
    result = fleet(
        "plan", str(llama_config_dir), "-dp", "2", "-tp", "2", "-n", "2", "-r", "1",
        "--master-addr", "10.0.0.1", "--master-port", "29500", "--device", "cpu",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["parallel"]["headless"] is True
    assert (plan["parallel"]["data_parallel_rank"], plan["parallel"]["data_parallel_size_local"]) == (1, 1)
    assert kinds(plan) == {"engine_core": 1, "worker": 2}, "a headless node runs no API server and no coordinator"
    assert of_kind(plan, "engine_core")[0]["dp_rank"] == 1
    assert [(w["rank"], w["local_rank"]) for w in of_kind(plan, "worker")] == [(2, 0), (3, 1)]
    assert plan["node"]["engine_transport"] == "tcp://10.0.0.1:29550"
    job_store = {"host": "10.0.0.1", "port": 29500, "hosted_by": "launcher"}
    assert plan["node"]["job_store"] == job_store
    assert engine_plan(plan)["store"] == job_store, "every world of a multi-node job meets in node 0's job store"


def test_plan_subprocess_bad_combination_exits_2_with_one_line(llama_config_dir):
    result = fleet(
        "plan", str(llama_config_dir), "--data-parallel-hybrid-lb", "--data-parallel-external-lb", "--device", "cpu"
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "--data-parallel-hybrid-lb" in result.stderr and "--data-parallel-external-lb" in result.stderr


# ---------------------------------------------------------------- main() in process


def test_main_plan_prints_json(llama_config_dir, capsys):
    assert main(["plan", str(llama_config_dir), "--device", "cpu", "--api-server-count", "2"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert kinds(plan) == {"api_server": 2, "engine_core": 1, "worker": 1, "sandbox": 4}


def test_main_plan_resolution_error_exits_2(llama_config_dir, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(llama_config_dir), "--dp", "3", "-n", "2", "--device", "cpu"])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert "--nnodes" in captured.err and "--data-parallel-size" in captured.err


def test_main_unknown_command_exits_2(capsys):
    assert main(["serve-everything"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "serve-everything" in err


def test_main_without_a_command_prints_usage(capsys):
    assert main(["--help"]) == 0
    assert "plan" in capsys.readouterr().out


def test_version_of_the_command_line():
    result = fleet("--version")
    assert result.returncode == 0 and result.stdout == f"fleet {fleet_package.__version__}\n"


# ---------------------------------------------------------------- node_plan for layouts


def test_one_replica_has_no_coordinator_and_uses_ipc(llama_config_dir):
    plan = plan_of(llama_config_dir)
    assert kinds(plan) == {"api_server": 1, "engine_core": 1, "worker": 1, "sandbox": 2}
    assert plan["node"]["engine_transport"] == "ipc"
    assert engine_plan(plan)["store"] is None, "a world of one worker needs no store"
    assert plan["device"]["distributed_backend"] == "gloo"


def test_a_replica_of_several_workers_meets_in_its_executors_store(llama_config_dir):
    one = plan_of(llama_config_dir, tensor_parallel_size=2, master_port=29600)
    assert engine_plan(one)["store"] == {"host": "127.0.0.1", "port": 29600, "hosted_by": "executor"}
    two = plan_of(llama_config_dir, tensor_parallel_size=2, data_parallel_size=2, master_port=29600)
    assert [e["store"]["port"] for e in two["node"]["engine_cores"]] == [0, 0], "replicas bind free ports"


def test_lock_step_replicas_meet_in_the_coordinators_store(moe_config_dir):
    plan = plan_of(moe_config_dir, data_parallel_size=2, enable_expert_parallel=True)
    store = {"host": "127.0.0.1", "port": 0, "hosted_by": "dp_coordinator"}
    assert plan["node"]["dp_coordinator"]["store"] == store
    assert [e["store"] for e in plan["node"]["engine_cores"]] == [store, store]


def test_api_servers_are_numbered(llama_config_dir):
    servers = of_kind(plan_of(llama_config_dir, api_server_count=3, port=9000), "api_server")
    assert [(s["index"], s["name"]) for s in servers] == [(0, "fleet-api-0"), (1, "fleet-api-1"), (2, "fleet-api-2")]
    assert all(s["url"] == "http://127.0.0.1:9000" for s in servers)


def test_process_names(llama_config_dir):
    plan = plan_of(llama_config_dir, tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    names = [p["name"] for p in planned_processes(plan)]
    assert names[:4] == ["fleet-api-0", "fleet-dp-coordinator", "fleet-engine-dp0", "fleet-engine-dp1"]
    assert "fleet-worker-dp1-pp1-tp0" in names
    assert len(of_kind(plan, "worker")) == 8


def test_node_zero_of_a_split_replica(llama_config_dir):
    plan = plan_of(llama_config_dir, tensor_parallel_size=4, nnodes=2, node_rank=0)
    assert kinds(plan) == {"api_server": 1, "engine_core": 1, "worker": 2, "sandbox": 2}
    assert of_kind(plan, "engine_core")[0]["worker_ranks"] == [0, 1, 2, 3]
    assert [w["rank"] for w in engine_plan(plan)["workers"]] == [0, 1], "the executor starts this node's two"
    assert plan["node"]["engine_transport"].startswith("tcp://")


def test_node_one_of_a_split_replica_runs_workers_only(llama_config_dir):
    plan = plan_of(llama_config_dir, tensor_parallel_size=4, nnodes=2, node_rank=1)
    assert kinds(plan) == {"worker": 2}
    assert [(w["rank"], w["local_rank"], w["tp_rank"]) for w in of_kind(plan, "worker")] == [(2, 0, 2), (3, 1, 3)]
    assert [w["rank"] for w in plan["node"]["workers_of_remote_engines"]] == [2, 3], "node 0's engine drives them"


def test_hybrid_node_serves_http_for_its_own_replicas(llama_config_dir):
    plan = plan_of(
        llama_config_dir, data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2, nnodes=2,
        node_rank=1, master_addr="10.0.0.1",
    )  # fmt: skip
    assert plan["parallel"]["data_parallel_hybrid_lb"] is True
    assert kinds(plan) == {"api_server": 1, "engine_core": 2, "worker": 2, "sandbox": 2}, "the coordinator lives beside rank 0"
    assert [e["dp_rank"] for e in of_kind(plan, "engine_core")] == [2, 3]


def test_external_launch_runs_one_replica(moe_config_dir):
    plan = plan_of(moe_config_dir, data_parallel_size=4, data_parallel_rank=3, enable_expert_parallel=True)
    assert plan["parallel"]["data_parallel_external_lb"] is True
    assert kinds(plan) == {"api_server": 1, "engine_core": 1, "worker": 1, "sandbox": 2}
    assert of_kind(plan, "engine_core")[0]["dp_rank"] == 3
    assert plan["groups"]["ep"] == [[0, 1, 2, 3]]
    assert plan["model"]["is_moe"] is True


def test_external_rank_zero_runs_the_coordinator(moe_config_dir):
    plan = plan_of(moe_config_dir, data_parallel_size=2, data_parallel_rank=0)
    assert kinds(plan) == {"api_server": 1, "dp_coordinator": 1, "engine_core": 1, "worker": 1, "sandbox": 2}


def test_cuda_workers_get_local_devices(llama_config_dir):
    plan = plan_of(llama_config_dir, device="cuda", tensor_parallel_size=2, data_parallel_size=2, nnodes=2, node_rank=1)
    assert [w["device"] for w in of_kind(plan, "worker")] == ["cuda:0", "cuda:1"]
    assert plan["device"]["distributed_backend"] == "nccl"


def test_plan_hides_the_api_key(llama_config_dir):
    plan = plan_of(llama_config_dir, api_key="secret")
    assert "api_key" not in plan["frontend"]
    assert "secret" not in json.dumps(plan)


def test_console_script_launch_help():
    import shutil

    script = shutil.which("fleet")
    if script is None:
        pytest.skip("the `fleet` console script is not on PATH")
    result = subprocess.run([script, "launch", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for group in ("ModelConfig:", "ParallelConfig:", "SchedulerConfig:", "CompilationConfig:"):
        assert group in result.stdout


def test_coordinator_addresses_follow_the_launch_layout(moe_config_dir, llama_config_dir):
    assert plan_of(llama_config_dir)["node"]["dp_coordinator"] is None
    local = plan_of(llama_config_dir, data_parallel_size=2)["node"]["dp_coordinator"]["addresses"]
    assert all(address.startswith("ipc://") for address in local.values())
    hybrid = plan_of(
        moe_config_dir, data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2,
        enable_expert_parallel=True, data_parallel_address="10.0.0.1", data_parallel_rpc_port=5000,
    )  # fmt: skip
    assert kinds(hybrid) == {"api_server": 1, "engine_core": 2, "worker": 2, "sandbox": 2}
    assert hybrid["parallel"]["replicas_step_together"] is True
    assert hybrid["node"]["dp_coordinator"] is None, "it runs beside rank 0, on the other launch"
    remote = engine_plan(hybrid)["coordinator"]
    assert (remote["engine_inputs"], remote["engine_broadcast"]) == ("tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001")
    dense_hybrid = plan_of(llama_config_dir, data_parallel_size=4, data_parallel_size_local=2, data_parallel_start_rank=2)
    assert engine_plan(dense_hybrid)["coordinator"] is None, "independent replicas: nothing to coordinate remotely"


def test_multi_node_addresses_are_tcp_on_node_0(llama_config_dir):
    plan = plan_of(
        llama_config_dir, data_parallel_size=2, nnodes=2, node_rank=1, master_addr="10.0.0.1",
        data_parallel_rpc_port=6000, api_server_count=2,
    )  # fmt: skip
    engine = engine_plan(plan)
    clients = [address for client in engine["clients"] for address in (client["requests"], client["outputs"])]
    assert clients == [f"tcp://10.0.0.1:{port}" for port in range(6002, 6006)]
    assert plan["node"]["job_store"] == {"host": "10.0.0.1", "port": 29501, "hosted_by": "launcher"}
    assert engine["coordinator"]["engine_inputs"] == "tcp://10.0.0.1:6000"
    one_node = plan_of(llama_config_dir)["node"]["api_servers"][0]["addresses"]
    assert all(address.startswith("ipc://") for address in one_node.values())
