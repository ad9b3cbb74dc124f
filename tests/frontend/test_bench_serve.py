"""`fleet bench serve` (and scripts/bench_serve.py, the same by path) end to
end: a subprocess against a real `fleet launch`, and its stream parsing
against streams that go wrong."""
from __future__ import annotations

import asyncio
import json
import math
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_serve.py"
"""The same load generator as `fleet bench serve`, run by path as shared/bench does."""
NUM_PROMPTS, OUTPUT_LEN = 8, 8


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")
    yield server
    assert server.stop() == 0


FLEET_BENCH_SERVE = ("-P", "-m", "fleet.frontend.cli", "bench", "serve")


def run_script(*args: str, command: tuple[str, ...] = (str(SCRIPT),)) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *command, *args], capture_output=True, text=True, timeout=60)


def bench(server: Server, tiny_llama_dir: str, tmp_path: Path, *extra: str,
          command: tuple[str, ...] = (str(SCRIPT),)) -> dict:
    result_json = tmp_path / "result.json"
    done = run_script(
        "--base-url", server.url, "--num-prompts", str(NUM_PROMPTS), "--max-concurrency", "4",
        "--random-input-len", "16", "--random-output-len", str(OUTPUT_LEN), "--tokenizer", str(tiny_llama_dir),
        "--result-json", str(result_json), "--label", "tiny", *extra, command=command,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Serving Benchmark Result (tiny)" in done.stdout
    return json.loads(result_json.read_text())


def assert_all_served(result: dict) -> None:
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result["errors"]
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert result["total_input_tokens"] >= NUM_PROMPTS * 8
    for key in ["duration", "request_throughput", "output_throughput", "total_token_throughput",
                "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms", "p99_itl_ms",
                "mean_e2el_ms"]:
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["mean_ttft_ms"] < result["mean_e2el_ms"]
    assert result["median_itl_ms"] >= 0


def test_completions_with_fleet_bench_serve(server, tiny_llama_dir, tmp_path):
    result = bench(server, tiny_llama_dir, tmp_path, command=FLEET_BENCH_SERVE)
    assert_all_served(result)
    assert result["model"] == server.get("/v1/models").json()["data"][0]["id"]
    assert result["endpoint"] == "/v1/completions"


def test_chat_with_poisson_arrivals(server, tiny_llama_dir, tmp_path):
    result = bench(server, tiny_llama_dir, tmp_path, "--endpoint", "/v1/chat/completions", "--request-rate", "50")
    assert_all_served(result)
    assert result["request_rate"] == 50.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_server_fails_clearly():
    url = f"http://127.0.0.1:{free_port()}"
    done = run_script("--base-url", url, "--num-prompts", "2")
    assert done.returncode == 1
    assert "cannot get a model" in done.stderr and "ConnectError" in done.stderr
    # With --model there is no lookup: every request fails, each with its error.
    done = run_script("--base-url", url, "--model", "m", "--num-prompts", "2", "--random-input-len", "4")
    assert done.returncode == 1
    assert "Failed requests:                         2" in done.stdout
    assert "failed request: ConnectError" in done.stderr and "all 2 requests failed" in done.stderr


# ---- stream parsing, against a fake server ----------------------------------------------------


@pytest.fixture(scope="module")
def bench_serve():
    from fleet.frontend import bench_serve

    return bench_serve


def send_to_fake(bench_serve, events: list[str], status: int = 200):
    body = "".join(f"data: {e}\n\n" for e in events).encode()
    transport = httpx.MockTransport(lambda request: httpx.Response(status, content=body))

    async def send():
        async with httpx.AsyncClient(transport=transport) as client:
            prompt = bench_serve.Prompt("hi", 1, 2)
            return await bench_serve.send_request(client, "http://fake/v1/completions", {}, prompt)

    return asyncio.run(send())


def chunk(text: str, finish: str | None = None) -> str:
    return json.dumps({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


def test_stream_counts_chunks_without_usage(bench_serve):
    result = send_to_fake(bench_serve, [chunk(""), chunk("a"), chunk("b"), chunk("", "length"), "[DONE]"])
    assert result.ok and result.num_output_tokens == 2 and len(result.itl) == 1


def test_stream_without_finish_fails(bench_serve):
    result = send_to_fake(bench_serve, [chunk("a"), chunk("b")])
    assert not result.ok and "stream ended without finishing" in result.error


def test_error_event_and_http_error_fail(bench_serve):
    result = send_to_fake(bench_serve, [chunk("a"), json.dumps({"error": {"message": "boom"}}), "[DONE]"])
    assert not result.ok and "boom" in result.error
    result = send_to_fake(bench_serve, [], status=503)
    assert not result.ok and result.error.startswith("HTTP 503")
