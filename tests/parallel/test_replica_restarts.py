"""A replica is the unit of failure (issue 28): kill a worker or the engine
core of one data-parallel replica under concurrent streaming clients, and
the others keep serving, requests that had no token yet are served there,
those mid-stream end with an error event, /health stays 200, and the
replica comes back under the same names serving the oracle's tokens."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest

from fleet.tests.engine.helpers import random_prompts
from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import assert_greedy_over_http, expected_texts, per_engine

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")
STREAMED_TOKENS = 48
"""Long enough that a replica dies with requests mid-stream; --max-num-seqs 2 keeps others waiting."""


@dataclass
class StreamingClient:
    """One streamed greedy completion, run on a thread: the text it got, and
    the error event that ended it, if one did."""

    server: Server
    prompt: list[int]
    text: str = ""
    error: dict | None = None
    tokens_before_error: int = 0
    thread: threading.Thread = field(init=False)

    def __post_init__(self):
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"prompt": self.prompt, "max_tokens": STREAMED_TOKENS, "min_tokens": STREAMED_TOKENS,
                "temperature": 0, "stream": True, "skip_special_tokens": False}
        chunks = 0
        with httpx.stream("POST", self.server.url + "/v1/completions", json=body, timeout=180) as response:
            assert response.status_code == 200, response.read()
            for line in response.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    self.error, self.tokens_before_error = event["error"], chunks
                    return
                self.text += event["choices"][0]["text"]
                chunks += 1

    def join(self) -> None:
        self.thread.join(180)
        assert not self.thread.is_alive(), "a client hangs"


class HealthWatch:
    """/health polled every 50 ms on a thread; every status it saw."""

    def __init__(self, server: Server):
        self.server = server
        self.statuses: list[int] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(0.05):
            try:
                self.statuses.append(self.server.get("/health", timeout=5).status_code)
            except httpx.HTTPError as error:
                self.statuses.append(type(error).__name__)

    def stop(self) -> list:
        self.stopping.set()
        self.thread.join()
        return self.statuses


def engine_metric(server: Server, name: str, engine: int) -> float:
    return per_engine({"0": server.get("/metrics").text}, name).get(str(engine), 0.0)


def replica_states(server: Server) -> list[str]:
    return [r["state"] for r in server.get("/health?verbose").json()["replicas"]]


def kill_under_load(server: Server, model_dir: str, victim_name: str, seed: int) -> list[StreamingClient]:
    """16 streaming clients; once replica 1 streams tokens, SIGKILL `victim_name`.
    Checks every client's outcome and that /health stayed 200 throughout."""
    prompts = random_prompts(16, 512, seed=seed, max_len=30)
    watch = HealthWatch(server)
    clients = [StreamingClient(server, prompt) for prompt in prompts]
    assert server.wait_until(lambda: engine_metric(server, "fleet:num_requests_running", 1) > 0
                             and any(c.text for c in clients), timeout=60)
    victim = next(p for p in psutil.Process(server.proc.pid).children(recursive=True)
                  if victim_name in " ".join(p.cmdline()))
    os.kill(victim.pid, signal.SIGKILL)
    for client in clients:
        client.join()
    expected = expected_texts(server, model_dir, prompts, STREAMED_TOKENS)
    for client, text in zip(clients, expected):
        if client.error is None:  # byte tokens of the tiny vocabulary: a stream may hold back a lone one
            assert client.text.replace("\ufffd", "") == text.replace("\ufffd", ""), "served in full"
        else:
            assert client.tokens_before_error > 0, f"a request that had no token failed: {client.error}"
            assert client.error["code"] == 503 and "dp1" in client.error["message"], client.error
    assert server.wait_until(lambda: replica_states(server) == ["up", "up"], timeout=90), replica_states(server)
    statuses = watch.stop()
    assert set(statuses) == {200}, f"/health answered {sorted(set(map(str, statuses)))} while replica 1 was down"
    return clients


@pytest.fixture
def ipc_dir():
    """FLEET_IPC_DIR of a launch: short (a socket path has at most 107 bytes), and empty."""
    path = Path(tempfile.mkdtemp(prefix="fleet-test-ipc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def assert_stopped_cleanly(server: Server, ipc_dir) -> None:
    server.refresh_descendants()
    assert server.stop() == 0
    assert not list(ipc_dir.iterdir()), "the launch removes its socket directory"


def test_a_dead_worker_then_a_dead_engine_core_cost_only_streams_in_flight(tiny_llama_dir, ipc_dir):
    server = Server(tiny_llama_dir, "--dp", "2", "--max-num-seqs", "2", *TINY, env={"FLEET_IPC_DIR": str(ipc_dir)})
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
    server = Server(tiny_llama_dir, "--dp", "2", "--tp", "2", "--max-num-seqs", "2", *TINY,
                    env={"FLEET_IPC_DIR": str(ipc_dir)})
    try:
        kill_under_load(server, tiny_llama_dir, "fleet-worker-dp1-pp0-tp1", seed=4)
        server.refresh_descendants()
        assert len(server.children_named("fleet-worker-dp1-")) == 2
        assert_greedy_over_http(server, tiny_llama_dir, count=8, seed=5)
    finally:
        assert_stopped_cleanly(server, ipc_dir)


def test_a_lone_replica_restarts_with_policy_always_and_holds_requests_meanwhile(tiny_llama_dir, ipc_dir):
    server = Server(tiny_llama_dir, "--replica-restart-policy", "always", *TINY, env={"FLEET_IPC_DIR": str(ipc_dir)})
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
