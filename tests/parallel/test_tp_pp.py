"""Tensor- and pipeline-parallel replicas: every layout gives transformers'
greedy tokens, through fleet.LLM and through `fleet launch` over HTTP."""
from __future__ import annotations

import os
import signal
import threading

import httpx
import pytest

import fleet
from fleet import SamplingParams
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, random_prompts
from fleet.tests.engine.oracle import greedy, hf_model, log_softmax
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

LAYOUTS = {
    "tiny_llama_dir": [(2, 1), (4, 1), (1, 2), (1, 4), (2, 2)],  # tp=4 with 2 KV heads: KV heads replicated
    "tiny_qwen2_dir": [(2, 1), (1, 2), (2, 2)],
    # The later architectures at tp 2 over HTTP (test_architectures_over_http.py); pp 2 here:
    "tiny_qwen3_dir": [(1, 2)],
    "tiny_gemma3_dir": [(1, 2)],  # local and global layers on either stage
}


@pytest.mark.parametrize(
    "model_fixture,tp,pp", [(model, tp, pp) for model, layouts in LAYOUTS.items() for tp, pp in layouts]
)
def test_greedy_matches_transformers(request, model_fixture, tp, pp):
    model_dir = str(request.getfixturevalue(model_fixture))
    oracle = hf_model(model_dir)
    prompts = random_prompts(6, oracle.config.vocab_size, seed=tp * 10 + pp, max_len=90)
    with fleet.LLM(model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes="2M",
                   tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=64) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, min_tokens=8), use_tqdm=False)
        for prompt, output in zip(prompts, outputs):
            assert output.outputs[0].token_ids == greedy(oracle, prompt, 8)
        assert_all_blocks_free(llm)
    assert_no_fleet_processes()


def test_logprobs_over_tp2_match_log_softmax(tiny_qwen2_dir):
    """Only tensor rank 0 receives the logits (a gather): sampled and prompt
    logprobs still come out whole, and right."""
    oracle = hf_model(str(tiny_qwen2_dir))
    prompt = random_prompts(1, oracle.config.vocab_size, seed=77, max_len=40)[0]
    params = SamplingParams(temperature=0, max_tokens=4, min_tokens=4, logprobs=3, prompt_logprobs=2)
    with fleet.LLM(str(tiny_qwen2_dir), dtype="float32", device="cpu", kv_cache_memory_bytes="2M",
                   tensor_parallel_size=2) as llm:
        output = llm.generate([prompt], params, use_tqdm=False)[0]
    sequence = output.outputs[0]
    reference = log_softmax(oracle, prompt + sequence.token_ids)
    assert len(output.prompt_logprobs) == len(prompt)
    for position, top in enumerate(output.prompt_logprobs[1:], start=1):
        token = prompt[position]
        assert abs(top[token].logprob - reference[position - 1][token].item()) < 1e-4
    for step, (token, top) in enumerate(zip(sequence.token_ids, sequence.logprobs, strict=True)):
        assert abs(top[token].logprob - reference[len(prompt) - 1 + step][token].item()) < 1e-4
    assert_no_fleet_processes()


def test_tp_that_does_not_divide_the_heads_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 must divide the model's 4 attention heads"):
        fleet.LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=3)


@pytest.fixture(scope="module")
def tp2_pp2_server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--tp", "2", "--pp", "2", "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")
    yield server
    server.close()


def test_http_greedy_over_tp2_pp2(tp2_pp2_server, tiny_llama_dir):
    server = tp2_pp2_server
    assert len(server.children_named("fleet-worker-")) == 4
    prompt = random_prompts(1, 512, seed=42)[0]
    response = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 8, "min_tokens": 8, "temperature": 0, "logprobs": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    tokens = server.post("/tokenize", json={"prompt": body["choices"][0]["text"], "add_special_tokens": False}).json()["tokens"]
    expected = greedy(hf_model(str(tiny_llama_dir)), prompt, 8)
    # Text round trips are not always token-exact: compare the decoded texts.
    detok = server.post("/detokenize", json={"tokens": expected}).json()["prompt"]
    assert body["choices"][0]["text"] == detok, (tokens, expected)


def test_sigkill_of_one_worker_fails_requests_and_the_node(tp2_pp2_server):
    server = tp2_pp2_server
    victim = server.children_named("fleet-worker-dp0-pp1-tp1")[0]
    result = {}

    def in_flight() -> None:
        result["response"] = server.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1500, "ignore_eos": True})

    thread = threading.Thread(target=in_flight)
    thread.start()
    assert server.wait_until(lambda: server.metric("fleet:num_requests_running") >= 1, timeout=10)
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=15)
    response = result["response"]
    assert response.status_code == 500, response.text
    assert "fleet-worker-dp0-pp1-tp1" in response.json()["error"]["message"]
    assert server.proc.wait(timeout=10) != 0
    server.assert_nothing_left()

    def health_fails() -> bool:
        try:
            return server.get("/health").status_code != 200
        except httpx.HTTPError:
            return True

    assert health_fails()
