"""Start, stop and failure of a whole `fleet launch` process tree."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from fleet.tests.frontend.server import Server, health_fails

pytestmark = pytest.mark.slow


def launch(model_dir: str, *extra: str) -> Server:
    return Server(model_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M", *extra)


def test_sigterm_stops_every_process_in_time(tiny_llama_dir):
    server = launch(str(tiny_llama_dir), "--shutdown-timeout", "3")
    assert len(server.descendants) >= 3  # API server, engine core, worker
    started = time.monotonic()
    assert server.stop(timeout=3 + 5) == 0
    assert time.monotonic() - started < 3 + 5


def test_fleet_serve_is_launch_by_vllms_name(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    command="serve")
    try:
        body = {"model": str(tiny_llama_dir), "prompt": [5, 17, 42], "max_tokens": 3, "min_tokens": 3}
        assert server.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
        log = "".join(server.log)
        assert "starting " in log and "1 engine core(s), 1 worker(s)" in log, "the launch says what it starts"
        assert re.search(r"loaded .* in \d+\.\d s: \d+\.\d\d GiB of weights", log), "and how long the weights took"
    finally:
        assert server.stop() == 0
    server.assert_nothing_left()


def test_sigterm_lets_requests_in_flight_finish_before_the_engines_stop(tiny_llama_dir):
    server = launch(str(tiny_llama_dir), "--dp", "2", "--api-server-count", "2", "--shutdown-timeout", "30")
    body = {"prompt": "hello", "max_tokens": 300, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert '"text"' in first
    assert rest[-1] == "data: [DONE]"
    assert '"finish_reason":"length"' in rest[-2].replace(" ", ""), rest[-2]
    assert server.proc.wait(timeout=30) == 0
    server.assert_nothing_left()


def test_requests_still_running_when_the_drain_ends_get_an_error_not_a_cut(tiny_llama_dir):
    """A stream gets a final error event and [DONE], a plain request a 503, a
    Responses stream `error` and `response.failed`, all naming
    --shutdown-timeout; the job still ends cleanly."""
    server = launch(str(tiny_llama_dir), "--shutdown-timeout", "2")
    long = {"prompt": "hello", "max_tokens": 2000, "ignore_eos": True}
    plain, responses = {}, {}

    def in_flight() -> None:
        plain["response"] = server.post("/v1/completions", json=long)

    def responses_stream_in_flight() -> None:
        # Its schema asks for more text than max_output_tokens can hold, so the random
        # model cannot end it; the drain ends it (it would end "incomplete", not "failed").
        schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 20000}}, "required": ["s"]}
        body = {"input": "hello", "max_output_tokens": 1900, "stream": True,
                "text": {"format": {"type": "json_schema", "name": "long", "schema": schema}}}
        with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as response:
            responses["events"] = [json.loads(line.removeprefix("data: ")) for line in response.iter_lines()
                                   if line.startswith("data: ")]

    threads = [threading.Thread(target=in_flight), threading.Thread(target=responses_stream_in_flight)]
    with httpx.stream("POST", server.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as response:
        lines = response.iter_lines()
        next(line for line in lines if line.startswith("data: "))
        for thread in threads:
            thread.start()
        assert server.wait_until(lambda: server.metric("fleet:num_requests_running") == 3, timeout=10)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    for thread in threads:
        thread.join(timeout=30)
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == 503 and "--shutdown-timeout 2 s" in error["message"], error
    assert plain["response"].status_code == 503, plain["response"].text
    assert "--shutdown-timeout 2 s" in plain["response"].json()["error"]["message"]
    error, failed = responses["events"][-2:]  # the Responses API's ending of a failed response
    assert error["type"] == "error" and "--shutdown-timeout 2 s" in error["message"], error
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert "--shutdown-timeout 2 s" in failed["response"]["error"]["message"]
    assert server.proc.wait(timeout=30) == 0
    server.assert_nothing_left()


def test_engine_sigkill_fails_health_and_the_launcher(tiny_llama_dir):
    server = launch(str(tiny_llama_dir))
    (engine,) = server.children_named("fleet-engine-dp0")
    os.kill(engine.pid, signal.SIGKILL)
    assert server.wait_until(lambda: health_fails(server), timeout=5)
    assert server.proc.wait(timeout=15) != 0
    server.assert_nothing_left()
    assert any("fleet-engine-dp0" in line and "died" in line for line in server.log)


IDLE_DEATHS = {
    "worker": ((), "fleet-worker-dp0-pp0-tp0"),
    "worker of tp 2": (("--tp", "2"), "fleet-worker-dp0-pp0-tp1"),
    "api server": (("--api-server-count", "2"), "fleet-api-1"),
    "dp coordinator": (("--dp", "2"), "fleet-dp-coordinator"),
    "engine of dp 2, never restarted": (("--dp", "2", "--replica-restart-policy", "never"), "fleet-engine-dp1"),
}


@pytest.mark.parametrize("extra, victim", IDLE_DEATHS.values(), ids=IDLE_DEATHS.keys())
def test_a_process_that_dies_while_the_server_is_idle_ends_the_job(tiny_llama_dir, extra, victim):
    """No request is in flight, so no step waits on anyone: the launcher
    watches its children, the engines their workers, all the time; /health
    stops answering 200 within 5 s and the job ends naming the dead process."""
    server = launch(str(tiny_llama_dir), *extra)
    (process,) = server.children_named(victim)
    time.sleep(1.0)  # idle
    os.kill(process.pid, signal.SIGKILL)
    try:
        assert server.wait_until(lambda: health_fails(server), timeout=5)
        assert server.proc.wait(timeout=15) != 0  # before the fix an idle job never noticed a dead worker
    finally:
        server.kill()  # a job that did not end would be left behind
    server.assert_nothing_left()
    assert any(victim in line and "died" in line for line in server.log), server.log[-10:]


def test_requests_get_503_while_the_engine_is_dead(tiny_llama_dir):
    server = launch(str(tiny_llama_dir))
    (engine,) = server.children_named("fleet-engine-dp0")
    os.kill(server.proc.pid, signal.SIGSTOP)  # hold the launcher back so the API server outlives the engine
    try:
        os.kill(engine.pid, signal.SIGKILL)
        assert server.wait_until(lambda: server.get("/health").status_code == 503, timeout=5)
        response = server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert response.status_code == 503
        assert "fleet-engine-dp0" in response.json()["error"]["message"]
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert server.proc.wait(timeout=15) != 0
    server.assert_nothing_left()


def test_api_key_and_two_api_servers(tiny_llama_dir, monkeypatch):
    server = launch(str(tiny_llama_dir), "--api-key", "sekrit", "--api-server-count", "2")
    try:
        assert len(server.children_named("fleet-api-")) == 2
        body = {"prompt": "hello", "max_tokens": 3}
        missing = server.post("/v1/completions", json=body)
        assert missing.status_code == 401 and missing.json()["error"]["code"] == 401
        wrong = server.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        prefix = server.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekri"})
        assert prefix.status_code == 401
        scheme = server.post("/v1/completions", json=body, headers={"Authorization": "bearer sekrit"})
        assert scheme.status_code == 200, "the scheme is case-insensitive"
        # The kernel spreads connections over both servers' shared socket; each answers.
        for _ in range(8):
            ok = server.post("/v1/completions", json=body, headers={"Authorization": "Bearer sekrit"})
            assert ok.status_code == 200, ok.text
        assert server.get("/health").status_code == 200  # outside /v1: no key needed
    finally:
        assert server.stop() == 0


def test_tp_that_does_not_divide_the_heads_is_refused_in_one_line(tiny_llama_dir):
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "fleet.frontend.cli", "launch", str(tiny_llama_dir), "--tp", "3", "--device", "cpu"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--tensor-parallel-size 3" in result.stderr and "4 attention heads" in result.stderr
