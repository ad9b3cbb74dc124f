"""Property-based fuzz of the routes that take a body: completions, chat
completions, responses, /tokenize and /detokenize, with bodies drawn from the server's
own OpenAPI schema (tests/frontend/schema_bodies.py). No body may get a 5xx
(nor a stream an error event of one), and after the fuzz every process still
runs and nothing is left tracked, running or holding KV blocks.

A second server, which runs a request's own chat template, takes hostile
chat bodies (tests/frontend/hostile_bodies.py: templates that allocate, loop
or escape, grammars that crash or exhaust llguidance): each is answered
below 500, a refusal in OpenAI's error shape, and the API server lives on, in the
same process, without growing.

FLEET_FUZZ_EXAMPLES sets the examples per route (CI: 150), and
FLEET_FUZZ_HOSTILE_EXAMPLES the hostile bodies (100); FLEET_FUZZ_RANDOM=1
draws new ones each run instead of the same derandomised sequence."""
from __future__ import annotations

import json
import os

import httpx
import psutil
import pytest
from hypothesis import HealthCheck, given, settings

from fleet.tests.frontend.hostile_bodies import chat_bodies, json_text, tokenize_body
from fleet.tests.frontend.schema_bodies import body_strategy
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]
EXAMPLES = int(os.environ.get("FLEET_FUZZ_EXAMPLES", "150"))
FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("FLEET_FUZZ_RANDOM") != "1",
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
HOSTILE_EXAMPLES = int(os.environ.get("FLEET_FUZZ_HOSTILE_EXAMPLES", "100"))
HOSTILE_SANDBOX_TIMEOUT_S = 0.5
SANDBOX = "fleet-sandbox-"
SANDBOX_PROCESSES = 2
"""--sandbox-processes' default: the pool each API server keeps."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    # A short context keeps every request the fuzz makes valid cheap to run, n=128 included.
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--max-model-len", "96")
    yield without_sandboxes(server)
    close_with_sandboxes(server)


@pytest.fixture(scope="module")
def hostile_server(tiny_llama_dir):
    """A server that runs a request's own chat template, with a short sandbox budget."""
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--max-model-len", "96", "--trust-request-chat-template",
                    "--sandbox-timeout", str(HOSTILE_SANDBOX_TIMEOUT_S))
    yield without_sandboxes(server)
    close_with_sandboxes(server)


def without_sandboxes(server: Server) -> Server:
    """Leave the sandbox processes out of `server.descendants`: one that runs
    past its budget or crashes is replaced by design (assert_server_whole_and_quiet
    counts the pool instead)."""
    server.descendants = [p for p in server.descendants if SANDBOX not in " ".join(p.cmdline())]
    return server


def sandboxes(server: Server) -> list[psutil.Process]:
    """The sandbox processes running now."""
    found = []
    for process in psutil.Process(server.proc.pid).children(recursive=True):
        try:
            if SANDBOX in " ".join(process.cmdline()) and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except psutil.NoSuchProcess:
            pass
    return found


def close_with_sandboxes(server: Server) -> None:
    """Stop the server; nothing of it may be left, the sandboxes of the moment included."""
    if server.proc.poll() is None:
        server.descendants = [*server.descendants, *sandboxes(server)]
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


def test_hostile_templates_and_grammars_get_no_server_error(hostile_server):
    """Each body to /v1/chat/completions (and those with a template to
    /tokenize too) is answered below 500, a refusal in OpenAI's error shape;
    the API server is the same process at the end, and no larger."""
    server = hostile_server
    (api,) = server.children_named("fleet-api-0")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for warm_up in (chat, {**chat, "structured_outputs": {"regex": "a+"}}, {**chat, "chat_template": "{{ 'x' }}"}):
        assert server.post("/v1/chat/completions", json=warm_up).status_code == 200
    rss_at_start = api.memory_info().rss
    with httpx.Client(base_url=server.url, timeout=60) as client:

        @settings(FUZZ_SETTINGS, max_examples=HOSTILE_EXAMPLES)
        @given(body=chat_bodies())
        def post(body):
            routes = [("/v1/chat/completions", body)]
            if "chat_template" in body or "chat_template_kwargs" in body:
                routes.append(("/tokenize", tokenize_body(body)))
            for route, sent in routes:
                content = json_text(sent)
                response = client.post(route, content=content, headers={"content-type": "application/json"})
                assert_answered(route, content, response)

        post()
    (api_now,) = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                  if "fleet-api-0" in " ".join(p.cmdline())]
    assert api_now.pid == api.pid and api.is_running(), "the API server was replaced"
    grown = api.memory_info().rss - rss_at_start
    assert grown < 100 * 2**20, f"the API server grew by {grown / 2**20:.0f} MiB"
    assert_server_whole_and_quiet(server)


def assert_answered(route: str, content: str, response: httpx.Response) -> None:
    """Below 500; a refusal in OpenAI's error shape; a stream without an error event of a 5xx."""
    shown = content if len(content) < 2000 else content[:2000] + f"... ({len(content)} characters)"
    assert response.status_code < 500, (route, shown, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) >= {"message", "type", "param", "code"}, response.text
    elif "text/event-stream" in response.headers.get("content-type", ""):
        for line in response.text.splitlines():
            assert '"code": 5' not in line and '"code":5' not in line, (route, shown, line)


def assert_server_whole_and_quiet(server: Server) -> None:
    assert all(process.is_running() for process in server.descendants), "a process of the server died"
    assert len(sandboxes(server)) == SANDBOX_PROCESSES, [p.cmdline() for p in sandboxes(server)]
    assert server.get("/health").status_code == 200

    def quiet() -> bool:
        return all(
            server.metric(name) == 0
            for name in ("fleet:api_server_tracked_requests", "fleet:num_requests_running",
                         "fleet:num_requests_waiting", "fleet:kv_cache_usage_perc")
        )  # fmt: skip

    assert server.wait_until(quiet, timeout=10), server.get("/metrics").text[-3000:]
