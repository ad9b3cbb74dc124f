"""Expert-parallel MoE over data-parallel replicas behind `fleet launch`:
the replicas form one world and step in lock-step (an idle one runs empty
steps while another has work), with internal, hybrid and external load
balancing. Outputs are compared with transformers."""
from __future__ import annotations

import time

import psutil
import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import (
    assert_greedy_over_http,
    free_port_pair,
    metrics_of_every_api_server,
    per_engine,
    start_together,
    stop_servers,
)

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")


@pytest.fixture(scope="module")
def ep_tp4_dp2_server(tiny_mixtral_dir):
    server = Server(
        tiny_mixtral_dir, "--tp", "4", "--dp", "2", "--enable-expert-parallel", "--api-server-count", "2", *TINY,
        startup_timeout=300,
    )  # fmt: skip
    yield server
    server.close()


def test_tp4_dp2_expert_parallel_gives_the_oracle_tokens_through_both_api_servers(ep_tp4_dp2_server, tiny_mixtral_dir):
    server = ep_tp4_dp2_server
    assert len(server.children_named("fleet-worker-")) == 8
    assert len(server.children_named("fleet-engine-dp")) == 2
    bodies = assert_greedy_over_http(server, tiny_mixtral_dir, count=32, seed=11)
    assert {b["api_server"] for b in bodies} == {"0", "1"}
    finished = per_engine(metrics_of_every_api_server(server, 2), "fleet:request_success_total")
    assert sum(finished.values()) >= 32
    assert finished.get("0", 0) > 0 and finished.get("1", 0) > 0, finished


def test_one_request_completes_while_the_other_replica_idles_then_all_go_quiet(ep_tp4_dp2_server, tiny_mixtral_dir):
    server = ep_tp4_dp2_server
    assert_greedy_over_http(server, tiny_mixtral_dir, count=1, seed=12)
    time.sleep(1.0)
    busy = cpu_percent_over(server.children_named("fleet-engine-dp") + server.children_named("fleet-worker-"), 1.0)
    assert all(percent < 10 for percent in busy.values()), f"busy while idle: {busy}"


def cpu_percent_over(processes: list[psutil.Process], seconds: float) -> dict[int, float]:
    for process in processes:
        process.cpu_percent()
    time.sleep(seconds)
    return {process.pid: process.cpu_percent() for process in processes}


# ---------------------------------------------------------------- launches that form one job


def job_flags() -> tuple[str, ...]:
    return ("--data-parallel-rpc-port", str(free_port_pair()), "--master-port", str(free_port_pair()))


def test_hybrid_two_launches_each_balance_their_own_engines(tiny_qwen2_moe_dir):
    job = (tiny_qwen2_moe_dir, "--dp", "4", "--data-parallel-size-local", "2", "--enable-expert-parallel",
           *job_flags(), *TINY)
    first = (*job, "--data-parallel-start-rank", "0", "--data-parallel-hybrid-lb")  # as vLLM asks of start rank 0
    servers = start_together(first, (*job, "--data-parallel-start-rank", "2"))
    try:
        assert [len(s.children_named("fleet-engine-dp")) for s in servers] == [2, 2]
        for index, server in enumerate(servers):
            assert_greedy_over_http(server, tiny_qwen2_moe_dir, count=8, seed=20 + index)
        served = [per_engine(metrics_of_every_api_server(s, 1), "fleet:request_success_total") for s in servers]
        assert set(served[0]) == {"0", "1"} and set(served[1]) == {"2", "3"}, served
    finally:
        stop_servers(servers)


def test_external_two_launches_of_one_replica_each(tiny_mixtral_dir):
    job = (tiny_mixtral_dir, "--dp", "2", "--enable-expert-parallel", *job_flags(), *TINY)
    servers = start_together((*job, "--data-parallel-rank", "0"), (*job, "--data-parallel-rank", "1"))
    try:
        assert [len(s.children_named("fleet-dp-coordinator")) for s in servers] == [1, 0]
        for index, server in enumerate(servers):
            assert_greedy_over_http(server, tiny_mixtral_dir, count=4, seed=30 + index)
    finally:
        stop_servers(servers)
