"""What the replica-failure tests share (test_replica_restarts.py, and the
multi-node one): streaming clients under which a replica is killed, /health
watched meanwhile, and each client's outcome checked against the oracle."""
from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import psutil

from fleet.tests.engine.helpers import random_prompts
from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import expected_texts, per_engine

STREAMED_TOKENS = 96
"""Long enough that a replica dies with requests mid-stream; --max-num-seqs 2 keeps others waiting.
(48 was not: on a loaded machine, where one GET /metrics can take seconds, a
replica's whole share of the 16 streams sometimes ended between two polls.)"""


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


def kill_under_load(server: Server, model_dir: str, victim: str | Callable[[], None], seed: int,
                    back: bool = True) -> list[StreamingClient]:
    """16 streaming clients; once replica 1 streams tokens, SIGKILL the
    process whose name has `victim` (or call `victim`). Checks every
    client's outcome, that /health stayed 200 throughout and (`back`) that
    replica 1 is up again."""
    prompts = random_prompts(16, 512, seed=seed, max_len=30)
    watch = HealthWatch(server)
    clients = [StreamingClient(server, prompt) for prompt in prompts]
    assert server.wait_until(lambda: engine_metric(server, "fleet:num_requests_running", 1) > 0
                             and any(c.text for c in clients), timeout=60)
    if callable(victim):
        victim()
    else:
        process = next(p for p in psutil.Process(server.proc.pid).children(recursive=True)
                       if victim in " ".join(p.cmdline()))
        os.kill(process.pid, signal.SIGKILL)
    for client in clients:
        client.join()
    expected = expected_texts(server, model_dir, prompts, STREAMED_TOKENS)
    for client, text in zip(clients, expected):
        if client.error is None:  # byte tokens of the tiny vocabulary: a stream may hold back a lone one
            assert client.text.replace("\ufffd", "") == text.replace("\ufffd", ""), "served in full"
        else:
            assert client.tokens_before_error > 0, f"a request that had no token failed: {client.error}"
            assert client.error["code"] == 503 and "dp1" in client.error["message"], client.error
    if back:
        assert server.wait_until(lambda: replica_states(server) == ["up", "up"], timeout=90), replica_states(server)
    statuses = watch.stop()
    assert set(statuses) == {200}, f"/health answered {sorted(set(map(str, statuses)))} while replica 1 was down"
    return clients
