"""Property-based fuzz of the routes that take a body: completions, chat
completions, /tokenize and /detokenize, with bodies drawn from the server's
own OpenAPI schema (tests/frontend/schema_bodies.py). No body may get a 5xx
(nor a stream an error event of one), and after the fuzz every process still
runs and nothing is left tracked, running or holding KV blocks.

FLEET_FUZZ_EXAMPLES sets the examples per route (CI: 150); FLEET_FUZZ_RANDOM=1
draws new ones each run instead of the same derandomised sequence."""
from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from fleet.tests.frontend.schema_bodies import body_strategy
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

ROUTES = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]
EXAMPLES = int(os.environ.get("FLEET_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("FLEET_FUZZ_RANDOM") != "1",
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # A short context keeps every request the fuzz makes valid cheap to run, n=128 included.
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--max-model-len", "96")
    yield server
    server.close()


@pytest.fixture(scope="module")
def openapi(server):
    return server.get("/openapi.json").json()


@pytest.mark.parametrize("route", ROUTES)
def test_no_body_gets_a_server_error(server, openapi, route):
    with httpx.Client(base_url=server.url, timeout=120) as client:

        @FUZZ_SETTINGS
        @given(body=body_strategy(openapi, route))
        def post(body):
            content = json.dumps(body)  # NaN, Infinity and lone surrogates (as \ud800) go out as a client may send them
            response = client.post(route, content=content, headers={"content-type": "application/json"})
            assert response.status_code < 500, (content, response.text)
            if response.status_code >= 400:
                assert set(response.json()["error"]) >= {"message", "type", "param", "code"}, response.text
            elif "text/event-stream" in response.headers.get("content-type", ""):
                for line in response.text.splitlines():
                    assert '"code": 5' not in line and '"code":5' not in line, (content, line)

        post()
    assert_server_whole_and_quiet(server)


def assert_server_whole_and_quiet(server: Server) -> None:
    assert all(process.is_running() for process in server.descendants), "a process of the server died"
    assert server.get("/health").status_code == 200

    def quiet() -> bool:
        return all(
            server.metric(name) == 0
            for name in ("fleet:api_server_tracked_requests", "fleet:num_requests_running",
                         "fleet:num_requests_waiting", "fleet:kv_cache_usage_perc")
        )  # fmt: skip

    assert server.wait_until(quiet, timeout=10), server.get("/metrics").text[-3000:]
