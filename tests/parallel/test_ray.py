"""Ray: workers (--distributed-executor-backend ray) and engine cores
(--data-parallel-backend ray) as actors on a local Ray cluster of two
virtual nodes of two CPUs each, made by the test; and a job submitted with
`ray job submit` and ended with `ray job stop`. Outputs are compared with
transformers; nothing may be left: no actor, placement group or process."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from fleet.tests.frontend.server import Server, health_fails
from fleet.tests.parallel.dp_helpers import assert_greedy_over_http, free_port_pair
from fleet.tests.parallel.replica_helpers import kill_under_load

ray = pytest.importorskip("ray", reason="the Ray tests need `pip install fleet[ray]` (make install-test does it)")

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")
NODE = {"num_cpus": 2, "object_store_memory": 80 * 2**20}


@pytest.fixture(scope="module")
def two_node_cluster():
    """Two virtual nodes with two CPUs each (a dashboard for the job server and the state API)."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            **NODE, "include_dashboard": True, "dashboard_port": free_port_pair(), "dashboard_host": "127.0.0.1"
        },
    )  # fmt: skip
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="ERROR")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def launch(cluster, model_dir: str, *args: str) -> Server:
    return Server(model_dir, *args, *TINY, env={"RAY_ADDRESS": cluster.address}, startup_timeout=180)


def bundle_nodes() -> list[set[str]]:
    """The nodes of each live placement group's bundles."""
    from ray.util import placement_group_table

    return [
        set(group["bundles_to_node_id"].values())
        for group in placement_group_table().values()
        if group["state"] != "REMOVED"
    ]


def assert_nothing_left_in_ray(timeout: float = 20.0) -> None:
    from ray.util.state import list_actors

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        actors = list_actors(filters=[("state", "=", "ALIVE")])
        if not actors and not bundle_nodes():
            return
        time.sleep(0.5)
    raise AssertionError(f"left in Ray: actors {[a.class_name for a in actors]}, placement groups {bundle_nodes()}")


def test_ray_executor_spreads_a_replica_over_two_nodes(two_node_cluster, tiny_llama_dir):
    server = launch(two_node_cluster, tiny_llama_dir, "--tp", "4", "--distributed-executor-backend", "ray")
    try:
        assert_greedy_over_http(server, tiny_llama_dir, count=4, seed=41)
        all_nodes = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
        assert bundle_nodes() == [all_nodes], "4 workers: one node's 2 CPUs are too few"
    finally:
        server.close()
    assert_nothing_left_in_ray()


def test_ray_data_parallel_backend_places_each_engine_with_its_workers(two_node_cluster, tiny_llama_dir):
    flags = ("--data-parallel-backend", "ray", "--distributed-executor-backend", "ray", "--data-parallel-rpc-port")
    server = launch(two_node_cluster, tiny_llama_dir, "--dp", "2", *flags, str(free_port_pair()))
    try:
        assert not server.children_named("fleet.core.launch.engine_process"), "engine cores are actors, not local processes"
        assert_greedy_over_http(server, tiny_llama_dir, count=6, seed=42)
        groups = bundle_nodes()
        assert len(groups) == 2 and len(groups[0] | groups[1]) == 2, groups
    finally:
        server.close()
    assert_nothing_left_in_ray()


RAY_IDLE_DEATHS = {
    "worker actor": (("--tp", "2", "--distributed-executor-backend", "ray"), "WorkerActor"),
    "engine actor, never restarted": (("--dp", "2", "--data-parallel-backend", "ray", "--distributed-executor-backend",
                                       "ray", "--replica-restart-policy", "never"), "EngineActor"),
}


@pytest.mark.parametrize("layout, actor_class", RAY_IDLE_DEATHS.values(), ids=RAY_IDLE_DEATHS.keys())
def test_an_actor_that_dies_while_idle_ends_the_job(two_node_cluster, tiny_llama_dir, layout, actor_class):
    """SIGKILL of an actor's process with no request in flight: its engine
    (for a worker) or the launcher (for an engine) hears it from Ray."""
    from ray.util.state import list_actors

    extra = ("--data-parallel-rpc-port", str(free_port_pair())) if "--dp" in layout else ()
    server = launch(two_node_cluster, tiny_llama_dir, *layout, *extra)
    try:
        actors = list_actors(filters=[("class_name", "=", actor_class), ("state", "=", "ALIVE")])
        time.sleep(1.0)  # idle
        os.kill(actors[0].pid, signal.SIGKILL)
        assert server.wait_until(lambda: health_fails(server), timeout=5)
        assert server.proc.wait(timeout=30) != 0
    finally:
        server.kill()
    assert any("(Ray actor) died" in line for line in server.log), "".join(server.log[-20:])
    server.assert_nothing_left()
    assert_nothing_left_in_ray()


def test_a_replica_of_ray_workers_is_restarted_while_the_other_serves(two_node_cluster, tiny_llama_dir):
    """The engine core of replica 1 dies: its worker actors and placement group go with it (their
    owner), and the launcher starts it again, which places new ones."""
    server = launch(two_node_cluster, tiny_llama_dir, "--dp", "2", "--distributed-executor-backend", "ray",
                    "--max-num-seqs", "2")
    try:
        kill_under_load(server, tiny_llama_dir, "fleet-engine-dp1", seed=43)
        assert_greedy_over_http(server, tiny_llama_dir, count=4, seed=44)
        server.refresh_descendants()
    finally:
        server.close()
    assert_nothing_left_in_ray()


def test_an_engine_actor_is_restarted_in_a_new_placement_group(two_node_cluster, tiny_llama_dir):
    flags = ("--data-parallel-backend", "ray", "--distributed-executor-backend", "ray", "--data-parallel-rpc-port")
    server = launch(two_node_cluster, tiny_llama_dir, "--dp", "2", "--max-num-seqs", "2", *flags, str(free_port_pair()))
    try:
        (pid,) = [int(m.group(1)) for line in server.log if (m := re.search(r"fleet-engine-dp1 \(pid (\d+)\): KV", line))]
        kill_under_load(server, tiny_llama_dir, lambda: os.kill(pid, signal.SIGKILL), seed=45)
        assert_greedy_over_http(server, tiny_llama_dir, count=4, seed=46)
        assert len(bundle_nodes()) == 2, "the dead replica's placement group went with it"
    finally:
        server.close()
    assert_nothing_left_in_ray()


def test_asking_for_more_devices_than_the_cluster_has_fails_in_time(two_node_cluster, tiny_llama_dir):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "fleet.frontend.cli", "launch", tiny_llama_dir, "--tp", "4", "--pp", "2",
         "--distributed-executor-backend", "ray", "--distributed-timeout-seconds", "3", "--port", "0", *TINY],
        capture_output=True, text=True, timeout=120, env={**os.environ, "RAY_ADDRESS": two_node_cluster.address},
    )  # fmt: skip
    assert result.returncode != 0
    assert "Ray could not place 8 workers of {'CPU': 1} within 3 s" in result.stderr, result.stderr[-3000:]
    assert "the cluster has 4 CPU free of 4 CPU" in result.stderr
    assert time.monotonic() - started < 60
    assert_nothing_left_in_ray()


def test_ray_job_submit_serves_http_and_ray_job_stop_ends_everything(two_node_cluster, tiny_llama_dir):
    dashboard = f"http://{two_node_cluster.webui_url}"
    port = free_port_pair()
    entrypoint = (
        f"{sys.executable} -m fleet.frontend.cli launch {tiny_llama_dir} --tp 2 --dp 2 "
        "--distributed-executor-backend ray "
        f"--port {port} {' '.join(TINY)}"
    )
    job_id = f"fleet-test-{os.getpid()}-{port}"
    submitted = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "submit", "--address", dashboard, "--no-wait",
         "--submission-id", job_id, "--", *entrypoint.split()], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr
    url = f"http://127.0.0.1:{port}"
    try:
        assert _wait_healthy(url, timeout=180), _job_logs(dashboard, job_id)
        response = httpx.post(url + "/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=60)
        assert response.status_code == 200, response.text
    finally:
        stopped = subprocess.run(
            [sys.executable, "-m", "ray.scripts.scripts", "job", "stop", "--address", dashboard, job_id],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert stopped.returncode == 0, stopped.stderr
    assert_nothing_left_in_ray()
    assert not [p for p in psutil.process_iter(["cmdline"]) if tiny_llama_dir in " ".join(p.info["cmdline"] or [])]


def _wait_healthy(url: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(1)
    return False


def _job_logs(dashboard: str, job_id: str) -> str:
    logs = subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", "job", "logs", "--address", dashboard, job_id],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return logs.stdout[-3000:] + json.dumps(os.environ.get("RAY_ADDRESS"))
