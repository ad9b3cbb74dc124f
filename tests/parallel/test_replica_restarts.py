"""A replica is the unit of failure (issue 28): kill a worker or the engine
core of one data-parallel replica under concurrent streaming clients, and
the others keep serving, requests that had no token yet are served there,
those mid-stream end with an error event, /health stays 200, and the
replica comes back under the same names serving the oracle's tokens."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import assert_greedy_over_http
from fleet.tests.parallel.replica_helpers import engine_metric, kill_under_load, replica_states

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")


@pytest.fixture
def ipc_dir():
    """FLEET_IPC_DIR of a launch: short (a socket path has at most 107 bytes), and empty."""
    path = Path(tempfile.mkdtemp(prefix="fleet-test-ipc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def launch(model_dir: str, ipc_dir: Path, *flags: str) -> Server:
    return Server(model_dir, *flags, *TINY, env={"FLEET_IPC_DIR": str(ipc_dir)})


def assert_stopped_cleanly(server: Server, ipc_dir) -> None:
    server.refresh_descendants()
    assert server.stop() == 0
    assert not list(ipc_dir.iterdir()), "the launch removes its socket directory"


def test_a_dead_worker_then_a_dead_engine_core_cost_only_streams_in_flight(tiny_llama_dir, ipc_dir):
    server = launch(tiny_llama_dir, ipc_dir, "--dp", "2", "--max-num-seqs", "2")
    try:
        engine = server.children_named("fleet-engine-dp1")[0]
        clients = kill_under_load(server, tiny_llama_dir, "fleet-worker-dp1-", seed=1)
        clients += kill_under_load(server, tiny_llama_dir, "fleet-engine-dp1", seed=2)
        assert any(c.error for c in clients), "some requests were mid-stream on replica 1"
        assert server.metric("fleet:requests_retried_total") > 0, "the waiting requests of replica 1 were re-sent"
        assert server.metric("fleet:replica_restarts_total") == 2
        server.refresh_descendants()
        engines = server.children_named("fleet-engine-dp1")
        assert len(engines) == 1 and engines[0].pid != engine.pid and engines[0].is_running()
        assert len(server.children_named("fleet-worker-dp1-pp0-tp0")) == 1
        before = engine_metric(server, "fleet:request_success_total", 1)
        assert_greedy_over_http(server, tiny_llama_dir, count=8, seed=3)
        assert engine_metric(server, "fleet:request_success_total", 1) > before, "the new replica 1 serves"
        assert sum("restarted: replica dp1 serves again" in line for line in server.log) == 2
    finally:
        assert_stopped_cleanly(server, ipc_dir)


def test_tp2_replica_comes_back_after_one_of_its_workers_dies(tiny_llama_dir, ipc_dir):
    server = launch(tiny_llama_dir, ipc_dir, "--dp", "2", "--tp", "2", "--max-num-seqs", "2")
    try:
        kill_under_load(server, tiny_llama_dir, "fleet-worker-dp1-pp0-tp1", seed=4)
        server.refresh_descendants()
        assert len(server.children_named("fleet-worker-dp1-")) == 2
        assert_greedy_over_http(server, tiny_llama_dir, count=8, seed=5)
    finally:
        assert_stopped_cleanly(server, ipc_dir)


def test_a_hung_worker_is_a_dead_replica_after_the_step_timeout(tiny_llama_dir, ipc_dir):
    server = launch(tiny_llama_dir, ipc_dir, "--dp", "2", "--max-num-seqs", "2", "--engine-step-timeout", "2")
    try:
        (worker,) = server.children_named("fleet-worker-dp1-")
        kill_under_load(server, tiny_llama_dir, lambda: os.kill(worker.pid, signal.SIGSTOP), seed=7)
        assert any("ran past --engine-step-timeout 2 s" in line for line in server.log)
        assert not worker.is_running(), "the hung worker was killed"
    finally:
        assert_stopped_cleanly(server, ipc_dir)


def test_a_lone_replica_restarts_with_policy_always_and_holds_requests_meanwhile(tiny_llama_dir, ipc_dir):
    server = launch(tiny_llama_dir, ipc_dir, "--replica-restart-policy", "always")
    try:
        os.kill(server.children_named("fleet-engine-dp0")[0].pid, signal.SIGKILL)
        assert server.wait_until(lambda: server.get("/health").status_code == 503, timeout=10)
        assert replica_states(server) == ["down"]
        # Sent while no replica serves: held, then answered by the restarted one.
        assert_greedy_over_http(server, tiny_llama_dir, count=2, seed=6)
        assert server.get("/health").status_code == 200
    finally:
        assert_stopped_cleanly(server, ipc_dir)


@pytest.mark.parametrize("flags, why", [
    (("--replica-restart-policy", "never"), "fleet-engine-dp1"),
    (("--max-replica-restarts", "0"), "--max-replica-restarts 0"),
])
def test_without_a_restart_one_dead_replica_ends_the_job(tiny_llama_dir, flags, why):
    server = Server(tiny_llama_dir, "--dp", "2", *flags, *TINY)
    os.kill(server.children_named("fleet-engine-dp1")[0].pid, signal.SIGKILL)
    assert server.proc.wait(timeout=30) != 0
    server.assert_nothing_left()
    assert any(why in line and "died" in line for line in server.log), "".join(server.log[-20:])


@pytest.mark.parametrize("flags, message", [
    (("--replica-restart-policy", "sometimes"), "'never', 'always', 'on-failure'"),
    (("--max-replica-restarts", "-1"), "--max-replica-restarts must be at least 0"),
    (("--engine-step-timeout", "0"), "--engine-step-timeout must be above 0 seconds"),
])
def test_bad_restart_flags_are_refused_naming_the_flag(tiny_llama_dir, flags, message):
    launch = [sys.executable, "-P", "-m", "fleet.frontend.cli", "plan", tiny_llama_dir, *flags, *TINY]
    result = subprocess.run(launch, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and message in result.stderr, result.stderr
