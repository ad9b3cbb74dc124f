"""Two nodes emulated on this machine: each `fleet launch` runs in its own
network namespace with its own address (ip netns, veth pairs on a bridge),
or, without the rights for that, on 127.0.0.1 with separate IPC
directories (also with FLEET_TEST_NETNS=0). Greedy outputs through node 0's HTTP are compared with
transformers; start order, a missing node and a dying node are exercised."""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest

from fleet.tests.config.plan_json import planned_processes, planned_tcp_ports
from fleet.tests.frontend.server import Server, health_fails
from fleet.tests.parallel.dp_helpers import (
    assert_greedy_over_http,
    free_port_pair,
    launched_names,
    launched_tcp_ports,
    stop_servers,
)
from fleet.tests.parallel.replica_helpers import engine_metric, kill_under_load, replica_states

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")


@dataclass
class Node:
    address: str
    prefix: tuple[str, ...] = ()
    """Command prefix that puts a process in the node's network namespace."""
    env: dict[str, str] = field(default_factory=dict)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class NetworkNamespaces:
    """Two namespaces on a bridge: 10.N.0.1 and 10.N.0.2, this process at 10.N.0.254."""

    def __init__(self) -> None:
        tag = os.getpid() % 10000
        self.bridge, self.namespaces = f"flbr{tag}", [f"flns{tag}-{i}" for i in range(2)]
        subnet = f"10.{200 + tag % 50}.{tag % 250}"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        self.nodes = []
        for i, namespace in enumerate(self.namespaces):
            outside, inside = f"flv{tag}-{i}", f"flp{tag}-{i}"
            _ip("netns", "add", namespace)
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", inside, "netns", namespace)
            _ip("link", "set", outside, "master", self.bridge)
            _ip("link", "set", outside, "up")
            _ip("-n", namespace, "addr", "add", f"{subnet}.{i + 1}/24", "dev", inside)
            _ip("-n", namespace, "link", "set", inside, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            self.nodes.append(Node(f"{subnet}.{i + 1}", ("ip", "netns", "exec", namespace)))

    def remove(self) -> None:
        for namespace in self.namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    namespaces = None
    if os.geteuid() == 0 and shutil.which("ip") and os.environ.get("FLEET_TEST_NETNS", "1") != "0":
        try:
            namespaces = NetworkNamespaces()
        except subprocess.CalledProcessError:
            namespaces = None
    if namespaces is not None:
        yield namespaces.nodes
        namespaces.remove()
        return
    ipc_dirs = [tmp_path_factory.mktemp(f"node{i}") for i in range(2)]
    yield [Node("127.0.0.1", env={"FLEET_IPC_DIR": str(d)}) for d in ipc_dirs]


def job_args(model_dir: str, nodes: list[Node], *layout: str, timeout: int = 120) -> tuple[str, ...]:
    # One free block for all fixed ports: the job store's, then the coordinator's two and the API server's two.
    master_port = free_port_pair(span=5)
    return (
        model_dir, *layout, "--nnodes", "2", "--master-addr", nodes[0].address,
        "--master-port", str(master_port), "--data-parallel-rpc-port", str(master_port + 1),
        "--distributed-timeout-seconds", str(timeout), *TINY,
    )  # fmt: skip


def node_args(nodes: list[Node], rank: int, args: tuple[str, ...]) -> tuple[str, ...]:
    return (*args, "--node-rank", str(rank), "--host", nodes[rank].address)


def start_node(nodes: list[Node], rank: int, args: tuple[str, ...], wait: bool = False) -> Server:
    node = nodes[rank]
    return Server(*node_args(nodes, rank, args), prefix=node.prefix, env=node.env, wait=wait)


def assert_launched_as_planned(nodes: list[Node], rank: int, args: tuple[str, ...], server: Server) -> None:
    """The node started the processes `fleet plan` shows for it (names carry
    their ranks), and each listens on the TCP ports the plan gives it."""
    command = [sys.executable, "-P", "-m", "fleet.frontend.cli", "plan", *node_args(nodes, rank, args), "--port", "0"]
    plan = json.loads(subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout)
    assert launched_names(server) == sorted(p["name"] for p in planned_processes(plan))
    listening = launched_tcp_ports(server)
    for name, ports in planned_tcp_ports(plan).items():
        assert ports <= listening[name], f"{name} listens on {sorted(listening[name])}, planned {sorted(ports)}"


@pytest.mark.parametrize("layout", [("--dp", "2", "--tp", "2"), ("--tp", "4"), ("--pp", "2")], ids=" ".join)
def test_two_nodes_give_the_oracle_tokens(two_nodes, tiny_llama_dir, layout):
    args = job_args(tiny_llama_dir, two_nodes, *layout)
    node1 = start_node(two_nodes, 1, args)  # node 1 first: start order does not matter
    time.sleep(1.0)
    node0 = start_node(two_nodes, 0, args)
    try:
        node0.wait_ready(180)
        node1.wait_ready(180)
        assert_greedy_over_http(node0, tiny_llama_dir, count=4, seed=sum(map(len, layout)))
        workers_per_node = math.prod(int(size) for size in layout[1::2]) // 2
        workers = [len(node.children_named("fleet-worker-")) for node in (node0, node1)]
        assert workers == [workers_per_node, workers_per_node]
        assert not node1.children_named("fleet-api-"), "node 1 is headless"
        assert_launched_as_planned(two_nodes, 0, args, node0)
        assert_launched_as_planned(two_nodes, 1, args, node1)
        assert int(node0.url.rsplit(":", 1)[1]) in launched_tcp_ports(node0)["fleet-api-0"]
    finally:
        stop_servers([node0, node1])


def test_a_node_that_never_comes_is_named_after_the_timeout(two_nodes, tiny_llama_dir):
    node0 = start_node(two_nodes, 0, job_args(tiny_llama_dir, two_nodes, "--tp", "2", timeout=4))
    assert node0.proc.wait(timeout=60) != 0
    log = "".join(node0.log)
    assert "node ranks [1] did not join within 4 s" in log, log[-2000:]
    node0.assert_nothing_left()


def test_sigkill_of_node_1_fails_requests_and_ends_both_nodes(two_nodes, tiny_llama_dir):
    args = job_args(tiny_llama_dir, two_nodes, "--tp", "4")
    node1 = start_node(two_nodes, 1, args)
    node0 = start_node(two_nodes, 0, args)
    node0.wait_ready(180)
    node1.wait_ready(180)
    result = {}

    def in_flight() -> None:
        body = {"prompt": "hello", "max_tokens": 1500, "ignore_eos": True}
        result["response"] = node0.post("/v1/completions", json=body)

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert node0.wait_until(lambda: node0.metric("fleet:num_requests_running") >= 1, timeout=30)
    os.kill(node1.proc.pid, signal.SIGKILL)
    thread.join(timeout=60)
    response = result["response"]
    assert response.status_code >= 500, response.text
    assert "error" in response.json()
    assert node0.proc.wait(timeout=60) != 0
    node1.proc.wait(timeout=10)
    node0.assert_nothing_left()
    node1.assert_nothing_left()


def test_a_remote_worker_that_dies_while_idle_ends_both_nodes(two_nodes, tiny_llama_dir):
    """The replica's engine runs on node 0, two of its workers on node 1:
    node 1 notices its worker, and tells node 0 through the job store."""
    args = job_args(tiny_llama_dir, two_nodes, "--tp", "4")
    node0, node1 = start_node(two_nodes, 0, args), start_node(two_nodes, 1, args)
    try:
        node0.wait_ready(180)
        node1.wait_ready(180)
        (worker,) = node1.children_named("fleet-worker-dp0-pp0-tp2")
        time.sleep(1.0)  # idle: no step waits on the worker
        os.kill(worker.pid, signal.SIGKILL)
        assert node0.wait_until(lambda: health_fails(node0), timeout=5)
        assert node0.proc.wait(timeout=30) != 0 and node1.proc.wait(timeout=30) != 0
    finally:
        node0.kill()
        node1.kill()
    assert "node 1 failed: fleet-worker-dp0-pp0-tp2" in "".join(node0.log), "".join(node0.log)[-2000:]
    node0.assert_nothing_left()
    node1.assert_nothing_left()


def test_an_idle_node_1_that_vanishes_ends_node_0(two_nodes, tiny_llama_dir):
    """SIGKILL of node 1's whole tree, as a machine that goes down: nothing
    is said, node 0 hears its heartbeat stop (and, told not to restart
    replicas, ends the job)."""
    args = job_args(tiny_llama_dir, two_nodes, "--dp", "2", "--tp", "2", "--replica-restart-policy", "never")
    node0, node1 = start_node(two_nodes, 0, args), start_node(two_nodes, 1, args)
    try:
        node0.wait_ready(180)
        node1.wait_ready(180)
        time.sleep(1.0)
        node1.kill()
        assert node0.wait_until(lambda: health_fails(node0), timeout=5)
        assert node0.proc.wait(timeout=30) != 0
    finally:
        node0.kill()
    assert "node 1 stopped answering" in "".join(node0.log), "".join(node0.log)[-2000:]
    node0.assert_nothing_left()
    node1.assert_nothing_left()


def test_node_0_serves_on_when_node_1_vanishes_and_node_1_rejoins(two_nodes, tiny_llama_dir):
    """A replica on each node. Node 1 goes down as a machine does, under
    streaming load: requests on its replica that had no token are served by
    node 0's, those mid-stream end with an error event, /health stays 200;
    node 1 launched again rejoins and its replica serves the oracle's tokens."""
    args = job_args(tiny_llama_dir, two_nodes, "--dp", "2", "--max-num-seqs", "2")
    node0, node1 = start_node(two_nodes, 0, args), start_node(two_nodes, 1, args)
    try:
        node0.wait_ready(180)
        node1.wait_ready(180)
        kill_under_load(node0, tiny_llama_dir, node1.kill, seed=11, back=False)
        assert "node 1 stopped answering" in "".join(node0.log) and node0.proc.poll() is None
        node1.assert_nothing_left()
        node1 = start_node(two_nodes, 1, args, wait=True)
        assert node0.wait_until(lambda: replica_states(node0) == ["up", "up"], timeout=60), replica_states(node0)
        before = engine_metric(node0, "fleet:request_success_total", 1)
        assert_greedy_over_http(node0, tiny_llama_dir, count=8, seed=12)
        assert engine_metric(node0, "fleet:request_success_total", 1) > before, "node 1's replica serves again"
        stop_servers([node0, node1])
    finally:
        node0.kill()
        node1.kill()


def test_sigkill_of_node_0_ends_node_1(two_nodes, tiny_llama_dir):
    args = job_args(tiny_llama_dir, two_nodes, "--dp", "2", "--tp", "2")
    node0, node1 = start_node(two_nodes, 0, args), start_node(two_nodes, 1, args)
    node0.wait_ready(180)
    node1.wait_ready(180)
    node0.kill()  # the launcher and its children, as a machine that goes down
    assert node1.proc.wait(timeout=60) != 0
    assert "lost node 0's job store" in "".join(node1.log)
    node1.assert_nothing_left()


def test_expert_parallel_replicas_on_two_nodes_step_together(two_nodes, tiny_mixtral_dir):
    args = job_args(tiny_mixtral_dir, two_nodes, "--dp", "2", "--tp", "2", "--enable-expert-parallel")
    node0, node1 = start_node(two_nodes, 0, args), start_node(two_nodes, 1, args)
    try:
        node0.wait_ready(180)
        node1.wait_ready(180)
        assert_greedy_over_http(node0, tiny_mixtral_dir, count=6, seed=5)
        assert_greedy_over_http(node0, tiny_mixtral_dir, count=1, seed=6)  # one replica idles through the wave
    finally:
        stop_servers([node0, node1])
