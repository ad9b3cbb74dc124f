"""The OpenAI-compatible server end to end: `fleet launch` as a subprocess,
the official openai client, outputs compared with fleet.LLM and transformers."""
from __future__ import annotations

import asyncio
import threading
import time

import httpx
import openai
import pytest

import fleet
from fleet import SamplingParams
from fleet.core.sampling_params import InvalidParameter
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

PROMPT = "hello world, this is a test"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "16M", "--max-model-len", "2048",
                    "--max-prompt-chars", "8M")  # a large prompt to tokenise
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    with fleet.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes="4M") as llm:
        yield llm


def model_name(server: Server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def test_models_health_version(server):
    assert server.get("/health").status_code == 200
    assert server.get("/version").json()["version"] == fleet.__version__
    assert len(server.get("/v1/models").json()["data"]) >= 1


def test_ping_load_and_one_models_card(server):
    assert server.get("/ping").status_code == 200 and server.post("/ping").status_code == 200
    name = model_name(server)
    card = server.get(f"/v1/models/{name}").json()
    assert card["id"] == name and card["object"] == "model" and card["max_model_len"] == 2048
    missing = server.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
    assert server.wait_until(lambda: server.get("/load").json() == {"server_load": 0})
    # Most of the context (seconds of decoding): still in flight when /load answers.
    body = {"model": name, "prompt": PROMPT, "max_tokens": 2000, "min_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")  # the first token is out: the request is in flight
        assert server.get("/load").json() == {"server_load": 1}
    assert server.wait_until(lambda: server.get("/load").json() == {"server_load": 0}), "the abort ended it"


def test_greedy_completion_equals_offline_llm(server, client, offline, tiny_llama_dir):
    response = client.completions.create(model=model_name(server), prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"min_tokens": 16})
    expected = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=16), use_tqdm=False)[0]
    assert response.choices[0].text == expected.outputs[0].text
    ids = offline.tokenizer.encode(PROMPT)
    assert expected.outputs[0].token_ids == greedy(hf_model(str(tiny_llama_dir)), ids, 16)
    assert response.usage.prompt_tokens == len(ids)
    assert response.usage.completion_tokens == 16
    assert response.usage.total_tokens == len(ids) + 16
    assert response.choices[0].finish_reason == "length"


def test_several_prompts_in_one_request(server, client):
    name = model_name(server)
    prompts = [PROMPT, "another prompt"]
    both = client.completions.create(model=name, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in both.choices) == [0, 1, 2, 3]
    for index, prompt in enumerate(prompts):
        alone = client.completions.create(model=name, prompt=prompt, max_tokens=6, temperature=0).choices[0].text
        assert [c.text for c in both.choices if c.index // 2 == index] == [alone, alone]


def test_streaming_completion_concatenates_to_the_full_text(server, client):
    kwargs = dict(model=model_name(server), prompt=PROMPT, max_tokens=20, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    stream = client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    pieces, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == full
    assert usage is not None and usage.completion_tokens == 20
    assert finish == "length"


def test_chat_and_chat_stream(server, client):
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model=model_name(server), messages=messages, max_tokens=12, temperature=0)
    assert full.choices[0].message.role == "assistant"
    assert 0 < full.usage.completion_tokens <= 12
    stream = client.chat.completions.create(model=model_name(server), messages=messages, max_tokens=12, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == full.choices[0].message.content


def test_n_stop_max_tokens_logprobs(server, client):
    name = model_name(server)
    two = client.completions.create(model=name, prompt=PROMPT, n=2, max_tokens=8, temperature=1.0, seed=3, extra_body={"min_tokens": 8})
    assert sorted(c.index for c in two.choices) == [0, 1]
    assert two.usage.completion_tokens == 16
    free = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    stopped = client.completions.create(model=name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop]).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(stop)]
    with_logprobs = client.completions.create(model=name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3).choices[0]
    assert len(with_logprobs.logprobs.token_logprobs) == 4
    assert all(len(top) >= 1 for top in with_logprobs.logprobs.top_logprobs)
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    assert len(chat.choices[0].logprobs.content) == 3
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 2


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


def test_errors_have_openai_shape(server):
    name = model_name(server)
    assert_openai_error(server.post("/v1/completions", json={"model": name, "prompt": "x", "temperature": -1}), 400, "temperature")
    assert_openai_error(server.post("/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 0}), 400, "max_tokens")
    assert_openai_error(server.post("/v1/completions", json={"model": name, "prompt": "x", "top_p": 2}), 400, "top_p")
    assert_openai_error(server.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model")
    malformed = server.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_openai_error(malformed, 400)
    assert_openai_error(server.post("/v1/completions", json={"model": name}), 400, "prompt")
    assert_openai_error(server.post("/v1/chat/completions", json={"model": name, "messages": "nope"}), 400, "messages")


@pytest.mark.parametrize(("num_prompt_tokens", "max_tokens", "param"), [(2048, 1, "prompt"), (2044, 8, "max_tokens")])
def test_a_request_past_the_context_is_refused_alike_over_http_and_offline(server, offline, num_prompt_tokens,
                                                                           max_tokens, param):
    """One validation for both paths (core/validation.py): the same parameter, the same message."""
    assert offline.config.model.max_model_len == 2048
    prompt = [5] * num_prompt_tokens
    body = {"model": model_name(server), "prompt": prompt, "max_tokens": max_tokens}
    error = assert_openai_error(server.post("/v1/completions", json=body), 400, param)
    with pytest.raises(InvalidParameter) as refused:
        offline.generate([prompt], SamplingParams(max_tokens=max_tokens), use_tqdm=False)
    assert (refused.value.param, str(refused.value)) == (param, error["message"])
    assert "maximum context length is 2048 tokens" in error["message"]


SERVER_KILLERS = [  # each of these once ended the whole server (a worker's IndexError) or gave a 500
    ('"logit_bias": {"100000": 5}', "logit_bias"),
    ('"logit_bias": {"-100000": 5}', "logit_bias"),
    ('"logit_bias": {"-1": 100}', "logit_bias"),
    ('"logit_bias": {"5": NaN}', "logit_bias"),
    ('"logit_bias": {"5": 1e308}', "logit_bias"),
    ('"stop_token_ids": [1000000000], "min_tokens": 2', "stop_token_ids"),
    (f'"stop_token_ids": [{2**70}]', "stop_token_ids.0"),
    (f'"seed": {2**64}', "seed"),
    (f'"top_k": {2**70}', "top_k"),
    ('"n": 20000', "n"),  # once queued 20000 engine requests
]


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_parameters_a_worker_would_trip_over_are_400s(server, route):
    name = model_name(server)
    prompt = '"prompt": "Hi"' if route == "/v1/completions" else '"messages": [{"role": "user", "content": "Hi"}]'
    for fields, param in SERVER_KILLERS:
        body = f'{{"model": "{name}", {prompt}, "max_tokens": 4, {fields}}}'
        response = server.post(route, content=body.encode(), headers={"content-type": "application/json"})
        assert_openai_error(response, 400, param)
    assert all(p.is_running() for p in server.descendants), "no process of the server died"
    ok = server.post(route, content=f'{{"model": "{name}", {prompt}, "max_tokens": 4}}'.encode(),
                     headers={"content-type": "application/json"})
    assert ok.status_code == 200, ok.text


UNENCODABLE = [  # each once gave a plain-text 500, closed the connection and left state behind
    ("/v1/completions", '{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "Hi", "max_tokens": 2, "stop": ["\\udfff"]}', "stop.0"),
    ("/v1/completions", f'{{"prompt": "Hi", "max_tokens": 2, "priority": {2**70}}}', "priority"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}',
     "messages.0.content"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud800", "content": "hi"}], "max_tokens": 2}', "messages.0.role"),
    ("/detokenize", '{"tokens": [-1]}', "tokens"),
    ("/detokenize", f'{{"tokens": [{2**70}]}}', "tokens.0"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
]


def test_unencodable_input_is_a_400_that_leaves_nothing_behind(server):
    api_server = server.children_named("fleet-api-0")[0]
    headers = {"content-type": "application/json"}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        def send_all() -> None:
            for route, body, param in UNENCODABLE:
                response = http.post(route, content=body.encode(), headers=headers)
                assert_openai_error(response, 400, param)
                assert response.headers.get("connection") != "close", "the connection stays open"

        for _ in range(10):  # warm up allocations
            send_all()
        before = api_server.memory_info().rss
        for _ in range(125):  # 1000 requests
            send_all()
        grown = api_server.memory_info().rss - before
    assert server.metric("fleet:api_server_tracked_requests") == 0
    assert grown < 16 * 2**20, f"the API server grew {grown / 2**20:.1f} MiB over 1000 bad requests"


def test_fields_fleet_cannot_honour_are_400s_naming_them(server):
    name = model_name(server)
    response = server.post("/v1/completions", json={"model": name, "prompt": "Hi", "suffix": "end", "max_tokens": 2})
    assert_openai_error(response, 400, "suffix")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]
    response = server.post("/v1/chat/completions", json={"model": name, "messages": messages, "max_tokens": 2})
    error = assert_openai_error(response, 400, "messages")
    assert "image_url" in error["message"]
    for malformed in ({"type": ["text"], "text": "hi"}, {"type": "text", "text": ["hi"]}, {"text": "hi"}):  # the fuzz found these 500s
        for route in ("/v1/chat/completions", "/tokenize"):
            response = server.post(route, json={"messages": [{"role": "user", "content": [malformed]}]})
            assert response.status_code == 400, response.text


def test_wrong_method_is_a_typed_405(server):
    response = httpx.get(server.url + "/v1/completions", timeout=30)
    assert response.status_code == 405
    assert response.json()["error"]["type"] == "MethodNotAllowedError"


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    body = b'{"prompt": "' + b"a" * (9 * 2**20) + b'", "max_tokens": 2}'  # the default limit is 8 MiB
    response = server.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    error = assert_openai_error(response, 413)
    assert "--max-request-body-bytes" in error["message"]
    assert server.get("/health").status_code == 200


def test_health_answers_while_a_large_prompt_is_tokenised(server):
    """Tokenising 6 MB (allowed by --max-prompt-chars) takes seconds; it runs beside the event loop, not on it."""
    tokenized: list[httpx.Response] = []
    worker = threading.Thread(target=lambda: tokenized.append(
        server.post("/tokenize", json={"prompt": "hello world " * 500_000})))
    worker.start()
    health_during = []
    while worker.is_alive():
        response = server.get("/health")
        if worker.is_alive():
            health_during.append(response.status_code)
        time.sleep(0.05)
    assert tokenized[0].status_code == 200 and tokenized[0].json()["count"] > 500_000
    assert health_during and set(health_during) == {200}, "/health answered while the prompt was tokenised"


def test_clients_that_give_up_on_non_streaming_requests_are_aborted(server):
    """Four clients time out after 0.5 s on requests of 2000 tokens each: the engine
    drops them as they leave (it would otherwise generate 8000 tokens nobody reads)."""
    generated_before = server.metric("fleet:generation_tokens_total")
    body = {"model": model_name(server), "prompt": "hi", "max_tokens": 2000, "ignore_eos": True}

    def give_up() -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(server.url + "/v1/completions", json=body, timeout=0.5)

    clients = [threading.Thread(target=give_up) for _ in range(4)]
    for client in clients:
        client.start()
    for client in clients:
        client.join()
    idle = lambda: server.metric("fleet:num_requests_running") + server.metric("fleet:num_requests_waiting") == 0  # noqa: E731
    assert server.wait_until(idle, timeout=10), "the engine still holds requests nobody waits for"
    generated = server.metric("fleet:generation_tokens_total") - generated_before
    assert generated < 4 * 2000 / 2, f"{generated} tokens generated for clients that had left"


def test_a_completion_without_max_tokens_stops_at_16(server):
    body = {"model": model_name(server), "prompt": "Hi", "ignore_eos": True}
    response = server.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_prompt_longer_than_the_model_is_a_400(server):
    response = server.post("/v1/completions", json={"model": model_name(server), "prompt": [7] * 10_000, "max_tokens": 4})
    error = assert_openai_error(response, 400, "prompt")
    assert "2048" in error["message"]
    assert server.get("/health").status_code == 200


def test_tokenize_detokenize(server):
    tokens = server.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert server.post("/detokenize", json={"tokens": tokens}).json()["prompt"].strip() == PROMPT


def test_64_concurrent_streams_then_16_cancelled(server):
    name = model_name(server)
    expected = openai.OpenAI(base_url=server.base_url, api_key="x").completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text

    async def stream_one(client: openai.AsyncOpenAI, cancel_after: int | None) -> str:
        stream = await client.completions.create(model=name, prompt=PROMPT, max_tokens=10 if cancel_after is None else 1000, temperature=0, stream=True)
        text, chunks = "", 0
        async for chunk in stream:
            text += chunk.choices[0].text if chunk.choices else ""
            chunks += 1
            if cancel_after is not None and chunks >= cancel_after:
                await stream.close()
                break
        return text

    async def run(count: int, cancel_after: int | None) -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=120) as client:
            return await asyncio.gather(*(stream_one(client, cancel_after) for _ in range(count)))

    texts = asyncio.run(run(64, None))
    assert texts == [expected] * 64
    assert server.wait_until(lambda: server.metric("fleet:kv_cache_usage_perc") == 0.0)
    asyncio.run(run(16, cancel_after=3))
    # Cancelled streams abort their requests: the engine frees their blocks.
    assert server.wait_until(lambda: server.metric("fleet:num_requests_running") == 0 and server.metric("fleet:kv_cache_usage_perc") == 0.0)
    assert server.metric('fleet:request_success_total') >= 64


def test_metrics_exposed(server):
    text = server.get("/metrics").text
    for name in ("fleet:num_requests_running", "fleet:num_requests_waiting", "fleet:kv_cache_usage_perc", "fleet:prompt_tokens_total",
                 "fleet:generation_tokens_total", "fleet:time_to_first_token_seconds", "fleet:inter_token_latency_seconds",
                 "fleet:e2e_request_latency_seconds", "fleet:prefix_cache_queries_total", "fleet:prefix_cache_hits_total"):
        assert name in text, name
