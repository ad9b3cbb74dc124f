"""The details of a response that vLLM users rely on, over HTTP on a tiny
model with transformers as the oracle: echo of token-id prompts, prompt
logprobs (echo + logprobs, and vLLM's prompt_logprobs), the sampled token
in top_logprobs, stop token ids left out of the text, the model name the
request used, continuous usage stats, and best_of refused."""
from __future__ import annotations

import json

import httpx
import pytest

from fleet.tests.engine.oracle import greedy, hf_model, log_softmax
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

PROMPT = [5, 17, 42, 99, 7, 23, 64, 11]


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--served-model-name", "alpha", "beta")
    yield server
    assert server.stop() == 0
    server.assert_nothing_left()


def complete(server: Server, **fields) -> dict:
    response = server.post("/v1/completions", json={"model": "alpha", "prompt": PROMPT, "temperature": 0, **fields})
    return response.json()


def detokenize(server: Server, tokens: list[int]) -> str:
    return server.post("/detokenize", json={"tokens": tokens}).json()["prompt"]


def test_echo_of_a_token_id_prompt_with_its_logprobs(server, tiny_llama_dir):
    choice = complete(server, echo=True, max_tokens=3, min_tokens=3, logprobs=1)["choices"][0]
    generated = greedy(hf_model(tiny_llama_dir), PROMPT, 3)
    assert choice["text"].startswith(detokenize(server, PROMPT))
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(PROMPT) + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None, "nothing predicts token 0"
    oracle = log_softmax(hf_model(tiny_llama_dir), PROMPT + generated)
    expected = [oracle[i - 1, token].item() for i, token in enumerate(PROMPT + generated) if i > 0]
    assert logprobs["token_logprobs"][1:] == pytest.approx(expected, abs=1e-3)


def test_prompt_logprobs_in_completions_and_chat(server, tiny_llama_dir):
    choice = complete(server, max_tokens=1, prompt_logprobs=2)["choices"][0]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(PROMPT) and entries[0] is None
    oracle = log_softmax(hf_model(tiny_llama_dir), PROMPT)
    for position, entry in enumerate(entries[1:], start=1):
        token = str(PROMPT[position])
        assert entry[token]["logprob"] == pytest.approx(oracle[position - 1, PROMPT[position]].item(), abs=1e-3)
        assert len(entry) <= 3, "the top 2 and the prompt's own token"
    chat = server.post("/v1/chat/completions", json={
        "model": "beta", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0,
    }).json()
    assert chat["prompt_logprobs"][0] is None and all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def test_the_sampled_token_is_always_in_top_logprobs(server):
    sampled = complete(server, max_tokens=6, temperature=1.0, seed=3, logprobs=0)["choices"][0]["logprobs"]
    assert [list(top) for top in sampled["top_logprobs"]] == [[token] for token in sampled["tokens"]]
    chat = server.post("/v1/chat/completions", json={
        "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 1.0,
        "seed": 4, "logprobs": True, "top_logprobs": 0,
    }).json()["choices"][0]["logprobs"]["content"]
    assert all([top["token"] for top in item["top_logprobs"]] == [item["token"]] for item in chat)


def test_a_stop_token_id_ends_the_text_without_its_text(server, tiny_llama_dir):
    generated = greedy(hf_model(tiny_llama_dir), PROMPT, 8)
    stop_at = next(i for i in range(1, 8) if generated[i] not in generated[:i])
    fields = {"max_tokens": 8, "stop_token_ids": [generated[stop_at]]}
    stopped = complete(server, **fields)["choices"][0]
    assert (stopped["finish_reason"], stopped["stop_reason"]) == ("stop", generated[stop_at])
    assert stopped["text"] == detokenize(server, generated[:stop_at]).rstrip("\ufffd")
    kept = complete(server, include_stop_str_in_output=True, **fields)["choices"][0]
    assert kept["text"] == detokenize(server, generated[: stop_at + 1]).rstrip("\ufffd")


def test_the_response_names_the_model_as_the_request_did(server):
    assert complete(server, model="beta", max_tokens=1)["model"] == "beta"
    chat = server.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert chat.json()["model"] == "alpha", "no model in the request: the first served name"


def test_continuous_usage_stats_in_every_chunk(server):
    body = {"model": "alpha", "prompt": PROMPT, "max_tokens": 5, "min_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    usages = []
    with httpx.stream("POST", f"{server.base_url}/completions", json=body, timeout=60) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                usages.append(json.loads(line[6:])["usage"])
    assert all(usage["prompt_tokens"] == len(PROMPT) for usage in usages)
    completion_tokens = [usage["completion_tokens"] for usage in usages]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5


def test_best_of_other_than_n_is_a_400(server):
    refused = complete(server, best_of=2, max_tokens=1)
    assert refused["error"]["param"] == "best_of" and refused["error"]["code"] == 400
    assert complete(server, best_of=1, max_tokens=1)["choices"]
