"""What a hostile client can make the server compute, tried over HTTP
against a real launch: templates that allocate or loop without end, grammars
that crash or exhaust llguidance, requests past every cap. Each is a 400
within the sandbox's budget; the API server never dies, its memory does not
grow and its CPU goes back to idle; normal requests are served throughout;
SIGTERM afterwards leaves nothing running."""
from __future__ import annotations

import json
import threading
import time

import httpx
import psutil
import pytest

from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

SANDBOX_TIMEOUT_S = 2.0
REQUEST_TOKENS = 128 * 2**10
"""--max-request-tokens' default, which the server below keeps."""
ANSWER_WITHIN_S = 5.0
"""The issue's bound for a hostile request's 400: the client gives up after this."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--trust-request-chat-template", "--sandbox-timeout", str(SANDBOX_TIMEOUT_S),
                    "--sandbox-memory-bytes", "512M")
    yield server
    sandboxes = server_processes(server)
    assert server.stop() == 0
    _, alive = psutil.wait_procs(sandboxes, timeout=10)
    assert not alive, f"left behind: {[p.cmdline() for p in alive]}"


def server_processes(server: Server) -> list[psutil.Process]:
    return psutil.Process(server.proc.pid).children(recursive=True)


def api_server(server: Server) -> psutil.Process:
    (process,) = server.children_named("fleet-api-0")
    return process


def model(server: Server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def refused(server: Server, route: str, body: dict, param: str, *words: str) -> None:
    """`body` gets a 400 naming `param` and `words` (a tuple: one of its words), within ANSWER_WITHIN_S."""
    response = httpx.post(server.url + route, json={"model": model(server), **body}, timeout=ANSWER_WITHIN_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    for word in words:
        assert any(alternative in error["message"] for alternative in ((word,) if isinstance(word, str) else word)), error


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


def chained_grammar(rules: int) -> str:
    """`r0: "t0" r1?`, `r1: "t1" r2?`, ...: llguidance recurses once per rule."""
    lines = ["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(rules - 1)] + [f'r{rules - 1}: "t{rules - 1}"']
    return "\n".join(lines)


HOSTILE = {
    "string repetition": ("/v1/chat/completions", chat(chat_template="{{ 'a' * 10**9 }}"), "messages",
                          ["--max-prompt-chars"]),
    "doubling in a loop": ("/v1/chat/completions", chat(chat_template=(
        "{% set ns = namespace(s='a') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}")),
        "messages", ["--sandbox-memory-bytes"]),
    "nested loops": ("/v1/chat/completions", chat(chat_template=(
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x")),
        "messages", ["--sandbox-timeout"]),
    "3,000 chained grammar rules": ("/v1/chat/completions",
                                    chat(structured_outputs={"grammar": chained_grammar(3000)}),
                                    # the sandbox's stack overflows, or on a busy machine its time runs out first
                                    "structured_outputs", [("SIGSEGV", "--sandbox-timeout")]),
    "50,000 choices": ("/v1/chat/completions", chat(structured_outputs={"choice": [f"c{i}" for i in range(50000)]}),
                       "structured_outputs", ["--max-structured-choices"]),
    "(a{1000}){1000}": ("/v1/completions", {"prompt": "x", "max_tokens": 2,
                                            "structured_outputs": {"regex": "(a{1000}){1000}"}},
                        # llguidance gives up on its size after ~1.5 s of masks: on a busy machine the budget ends first
                        "structured_outputs", [("too many", "--sandbox-timeout")]),
    "self-referencing $ref": ("/v1/chat/completions", chat(response_format={
        "type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}), "structured_outputs", []),
    "5,000 tools": ("/v1/chat/completions", chat(tool_choice="required", tools=[
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(5000)]),
        "tools", ["--max-tools"]),
    "huge n x max_tokens": ("/v1/completions", {"prompt": "x", "n": 128, "max_tokens": 2000},
                            "max_tokens", ["--max-request-tokens"]),
    # --max-request-tokens counts the whole request: each prompt of these fits, all of them do not
    "2,048 prompts x n 64 x max_tokens 2,000": ("/v1/completions", {"prompt": ["x"] * 2048, "n": 64,
                                                                    "max_tokens": 2000},
                                                "max_tokens", ["--max-request-tokens", str(REQUEST_TOKENS)]),
    "echo with logprobs 20 over 64 prompts": ("/v1/completions", {"prompt": ["word " * 200] * 64, "echo": True,
                                                                  "logprobs": 20, "max_tokens": 1},
                                              "logprobs", ["--max-request-tokens", str(REQUEST_TOKENS)]),
    "prompt_logprobs 20 x n 8 of a chat": ("/v1/chat/completions", chat(
        messages=[{"role": "user", "content": "word " * 300}], n=8, prompt_logprobs=20),
        "logprobs", ["--max-request-tokens"]),
    "3,000 prompts": ("/v1/completions", {"prompt": ["x"] * 3000, "max_tokens": 1},
                      "prompt", ["--max-inputs-per-request"]),
    "a prompt longer than any context": ("/v1/completions", {"prompt": "ab " * 200000, "max_tokens": 1},
                                         "prompt", ["--max-prompt-chars"]),
}


class NormalTraffic:
    """Chats sent one after another from a thread while the hostile requests run."""

    def __init__(self, server: Server):
        self.server = server
        self.statuses: list[int] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        name = model(self.server)
        with httpx.Client(base_url=self.server.url, timeout=60) as client:
            while not self.stop.is_set():
                body = {"model": name, "max_tokens": 3, "messages": [{"role": "user", "content": "hello"}]}
                self.statuses.append(client.post("/v1/chat/completions", json=body).status_code)

    def finish(self) -> list[int]:
        self.stop.set()
        self.thread.join(60)
        return self.statuses


def test_hostile_requests_cost_a_400_and_nothing_else(server):
    api = api_server(server)
    assert server.post("/v1/chat/completions", json={"model": model(server), **chat()}).status_code == 200
    rss_at_start = api.memory_info().rss
    traffic = NormalTraffic(server)
    for name, (route, body, param, words) in HOSTILE.items():
        refused(server, route, body, param, *words)
        assert api.is_running() and server.get("/health").status_code == 200, name
    statuses = traffic.finish()
    assert statuses and set(statuses) == {200}, statuses
    assert api.memory_info().rss - rss_at_start < 100 * 2**20
    busy = cpu_percent_over([api, *api.children()], 1.0)
    assert max(busy.values()) < 50, busy


def test_a_body_nested_past_the_stack_is_a_400(server):
    """JSON nested ~1,000 deep parses, and every walk of it that recurses would run out of stack."""
    for depth in (150, 950, 5000):
        nested = "[" * depth + "]" * depth
        content = json.dumps({"model": model(server), **chat()})[:-1] + f', "chat_template_kwargs": {{"x": {nested}}}}}'
        response = httpx.post(server.url + "/v1/chat/completions", content=content,
                              headers={"content-type": "application/json"}, timeout=ANSWER_WITHIN_S)
        assert response.status_code == 400, (depth, response.text)
        if depth < 1000:  # deeper fails in the JSON parser, with its own message
            error = response.json()["error"]
            assert error["param"] == "chat_template_kwargs" and "deeper than 100 levels" in error["message"], error


def test_a_legitimate_grammar_and_template_still_serve(server):
    body = chat(structured_outputs={"grammar": chained_grammar(200)}, max_tokens=8)
    response = server.post("/v1/chat/completions", json={"model": model(server), **body})
    assert response.status_code == 200, response.text
    text = response.json()["choices"][0]["message"]["content"]
    assert text.startswith("t0"), text
    doubled = "{% set ns = namespace(s='ab') %}{% for i in range(3) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}"
    response = server.post("/tokenize", json={"model": model(server), "messages": [{"role": "user", "content": "x"}]})
    assert response.status_code == 200
    response = server.post("/v1/chat/completions", json={"model": model(server), **chat(chat_template=doubled)})
    plain = server.post("/tokenize", json={"prompt": "ab" * 8, "add_special_tokens": False}).json()["tokens"]
    assert response.json()["usage"]["prompt_tokens"] == len(plain)
    rendered = server.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}], "chat_template": doubled})
    assert rendered.json()["tokens"] == plain, "/tokenize renders messages as the chat request does"


def test_the_count_spans_the_whole_request_and_ordinary_requests_pass(server):
    """2,048 prompts x n 64 x max_tokens 2,000: refused at the second prompt, with its count; a long prompt
    echoed with logprobs, n 3, and 64 short prompts x n 2 are served."""
    name = model(server)
    refusal = server.post("/v1/completions", json={"model": name, "prompt": ["x"] * 2048, "n": 64, "max_tokens": 2000})
    assert refusal.status_code == 400, refusal.text
    prompt_tokens = server.post("/tokenize", json={"prompt": "x"}).json()["count"]
    message = refusal.json()["error"]["message"]
    assert f"counts {2 * 64 * (prompt_tokens + 2000)} tokens" in message and "first 2 prompts" in message, message
    long_prompt = "word " * 500
    echoed = server.post("/v1/completions", json={"model": name, "prompt": long_prompt, "n": 3, "echo": True,
                                                   "logprobs": 5, "max_tokens": 4})
    assert echoed.status_code == 200, echoed.text
    choices = echoed.json()["choices"]
    assert len(choices) == 3 and all(choice["text"].startswith(long_prompt) for choice in choices)
    many = server.post("/v1/completions", json={"model": name, "prompt": ["hello"] * 64, "n": 2, "max_tokens": 4})
    assert many.status_code == 200 and len(many.json()["choices"]) == 128, many.text


class LargeRequest:
    """One `n=64, max_tokens=2000, ignore_eos` completion streamed from a
    thread until `close()`; `finished` says whether it ended first."""

    BODY = {"prompt": "Write a long story.", "n": 64, "max_tokens": 2000, "ignore_eos": True, "stream": True}

    def __init__(self, server: Server):
        self.chunks = 0
        self.finished = False
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self.thread.start()

    def _run(self, server: Server) -> None:
        body = {"model": model(server), **self.BODY}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if self.closing.is_set():
                    return  # leaving the block drops the connection: the server aborts the request
                self.chunks += 1
                self.finished = line == "data: [DONE]"

    def close(self) -> None:
        self.closing.set()
        self.thread.join(60)


def test_a_small_chat_is_served_beside_four_n64_requests(server):
    """Fair share: 256 sequences of four requests fill a 4 MiB KV cache (4,096
    tokens), and another client's 4-token chat still runs at once, before any
    of them ends, and answers as it does alone."""
    small = {"model": model(server), **chat(max_tokens=4, temperature=0)}
    alone = server.post("/v1/chat/completions", json=small).json()["choices"][0]["message"]["content"]
    large = [LargeRequest(server) for _ in range(4)]
    try:
        sequences = ("fleet:num_requests_running", "fleet:num_requests_waiting")
        assert server.wait_until(lambda: sum(map(server.metric, sequences)) == 4 * 64, timeout=60), "all accepted"
        waiting = lambda: server.metric("fleet:num_requests_waiting")
        assert server.wait_until(lambda: waiting() > 0, timeout=60), "the cache is full: sequences wait for room"
        response = server.post("/v1/chat/completions", json=small, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == alone
        assert not any(request.finished for request in large), "the chat waited for a large request to end"
    finally:
        for request in large:
            request.close()
    assert server.wait_until(lambda: server.metric("fleet:num_requests_running") == 0, timeout=30)


def test_a_requests_template_needs_the_flag(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--sandbox-processes", "1")
    try:
        for route in ("/v1/chat/completions", "/tokenize"):
            refused(server, route, chat(chat_template="{{ 'x' }}"), "chat_template", "--trust-request-chat-template")
        refused(server, "/v1/chat/completions", chat(chat_template_kwargs={"big": "x" * 100_000}),
                "chat_template_kwargs", "bytes")
        assert server.post("/v1/chat/completions", json={"model": model(server), **chat(
            chat_template_kwargs={"enable_thinking": False})}).status_code == 200
    finally:
        server.close()


def cpu_percent_over(processes: list[psutil.Process], seconds: float) -> dict[int, float]:
    for process in processes:
        process.cpu_percent()
    time.sleep(seconds)
    return {process.pid: process.cpu_percent() for process in processes}


def test_sigterm_ends_a_busy_api_server_in_time(tiny_llama_dir):
    """The stop comes while a template runs past its budget in the sandbox."""
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--trust-request-chat-template", "--sandbox-timeout", "30", "--shutdown-timeout", "2")
    loop = chat(chat_template="{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x")
    body = json.dumps({"model": model(server), **loop})
    sender = threading.Thread(target=lambda: _post_ignoring_errors(server.url + "/v1/chat/completions", body),
                              daemon=True)
    sender.start()
    time.sleep(1.0)
    processes = server_processes(server)
    started = time.monotonic()
    server.proc.terminate()
    server.proc.wait(2 + 5 + 10)
    took = time.monotonic() - started
    _, alive = psutil.wait_procs(processes, timeout=10)
    assert not alive, f"left behind: {[p.cmdline() for p in alive]}"
    assert took < 2 + 5 + 10, took


def _post_ignoring_errors(url: str, body: str) -> None:
    try:
        httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
    except httpx.HTTPError:
        pass
