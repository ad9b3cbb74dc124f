"""Prefill/decode disaggregation as a user runs it: a prefill instance and a
decode instance (separate `fleet launch`es, tensor parallel on both sides)
behind `fleet proxy`; greedy outputs against transformers; the decode
instance's metrics show that it pulled the prompts' KV instead of computing
them; a transfer that fails and a prefill instance that dies cost no request."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fleet.tests.engine.helpers import random_prompts
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M", "--tensor-parallel-size", "2")
MAX_TOKENS = 6


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_role": role, "kv_connector": "FleetConnector", "kv_connector_extra_config": extra})


@pytest.fixture(scope="module")
def instances(tiny_llama_dir):
    prefill = Server(tiny_llama_dir, *TINY, "--kv-transfer-config", kv_config("kv_producer"))
    decode = Server(tiny_llama_dir, *TINY, "--kv-transfer-config", kv_config("kv_consumer", transfer_timeout_s=1))
    proxy = Server("--prefill", prefill.url, "--decode", decode.url, command="proxy")
    yield prefill, decode, proxy
    for server in (proxy, decode, prefill):
        server.close()


def complete(base_url: str, prompt: list[int], stream: bool = False, **extra) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0,
            "skip_special_tokens": False, "stream": stream, **extra}
    if not stream:
        response = httpx.post(base_url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def expected(server: Server, model_dir: str, prompts: list[list[int]]) -> list[str]:
    oracle = hf_model(model_dir)
    tokens = [greedy(oracle, prompt, MAX_TOKENS) for prompt in prompts]
    # Random token ids may split a UTF-8 character at either end of the output: the server's text and
    # /detokenize's show such a byte differently (the stream holds it back, /detokenize as U+FFFD).
    return [server.post("/detokenize", json={"tokens": t}).json()["prompt"].strip("\ufffd") for t in tokens]


def test_outputs_through_the_proxy_match_transformers_and_the_decode_instance_computes_no_prompt(
        instances, tiny_llama_dir):
    prefill, decode, proxy = instances
    prompts = random_prompts(8, 512, seed=3, max_len=60)
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda i: complete(proxy.url, prompts[i], stream=i % 2 == 1), range(len(prompts))))
    assert [t.strip("\ufffd") for t in texts] == expected(decode, tiny_llama_dir, prompts)
    assert proxy.get("/proxy/stats").json() == {"prefilled": len(prompts), "fallbacks": 0}
    # Each prompt's KV but its last token came from the prefill instance; none was computed on the decode one.
    transferred = sum(len(p) - 1 for p in prompts)
    assert decode.wait_until(lambda: decode.metric("fleet:kv_transfer_tokens_total") == transferred)
    assert decode.metric("fleet:prefix_cache_hits_total") == 0
    assert decode.metric("fleet:kv_transfer_failures_total") == 0
    # The prefill instance freed every prompt's blocks once they were pulled (the usage it
    # reports with a later request's answer counts the blocks held for transfers).
    assert prefill.wait_until(lambda: _kv_usage_after_a_request(prefill) == 0.0)


def test_a_failed_transfer_computes_the_prompt_on_the_decode_instance(instances, tiny_llama_dir):
    prefill, decode, proxy = instances
    prompts = random_prompts(3, 512, seed=4, max_len=40)
    answer = httpx.post(prefill.url + "/v1/completions", timeout=60, json={
        "prompt": prompts[0], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
    params = answer["kv_transfer_params"]
    unreachable = {**params, "remote_kv_addresses": ["tcp://127.0.0.1:9", "tcp://127.0.0.1:9"]}
    unknown = {**params, "remote_request_id": "never-ran", "remote_num_tokens": len(prompts[1]),
               "remote_block_ids": list(range(len(prompts[1])))}
    nonsense = {**unknown, "remote_kv_addresses": ["not an address", "tcp://"],  # a client's: no worker dies
                "remote_num_tokens": len(prompts[2])}
    failures = decode.metric("fleet:kv_transfer_failures_total")
    texts = [complete(decode.url, prompts[0], kv_transfer_params=unreachable),
             complete(decode.url, prompts[1], kv_transfer_params=unknown),
             complete(decode.url, prompts[2], kv_transfer_params=nonsense)]
    assert [t.strip("\ufffd") for t in texts] == expected(decode, tiny_llama_dir, prompts)
    assert decode.wait_until(lambda: decode.metric("fleet:kv_transfer_failures_total") == failures + 3)


def test_kv_transfer_params_an_instance_cannot_take_are_a_400(instances):
    prefill, decode, _ = instances
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    refused = [
        (decode, {"do_remote_decode": True}),  # a consumer holds no KV for others
        (prefill, {"do_remote_prefill": True}),  # a producer pulls none
        (decode, {"do_remote_prefill": "yes"}),
        (decode, ["not", "an", "object"]),
    ]
    for server, params in refused:
        response = server.post("/v1/completions", json={**body, "kv_transfer_params": params})
        assert response.status_code == 400, (params, response.text)
        assert response.json()["error"]["param"] == "kv_transfer_params"


def test_a_dead_prefill_instance_costs_no_request(instances, tiny_llama_dir):
    prefill, decode, proxy = instances
    prefill.kill()
    prefill.assert_nothing_left()
    prompts = random_prompts(4, 512, seed=5, max_len=40)
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(proxy.url, p, stream=True), prompts))
    assert [t.strip("\ufffd") for t in texts] == expected(decode, tiny_llama_dir, prompts)
    assert proxy.get("/proxy/stats").json()["fallbacks"] == len(prompts)
    assert proxy.get("/health").status_code == 200


def _kv_usage_after_a_request(server: Server) -> float:
    assert server.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200
    return server.metric("fleet:kv_cache_usage_perc")


# ---- one launch: --disaggregate ------------------------------------------------------------------


@pytest.fixture(scope="module")
def disaggregated(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M",
                    "--disaggregate", "prefill=1,decode=1,min_prompt_tokens=8")
    yield server
    server.close()


def test_one_launch_prefills_on_one_replica_and_decodes_on_the_other(disaggregated, tiny_llama_dir):
    from fleet.tests.parallel.dp_helpers import per_engine

    server = disaggregated
    prompts = [p for p in random_prompts(8, 512, seed=6, max_len=60) if len(p) >= 8][:6]
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda i: complete(server.url, prompts[i], stream=i % 2 == 0), range(len(prompts))))
    assert [t.strip("\ufffd") for t in texts] == expected(server, tiny_llama_dir, prompts)
    transferred = sum(len(p) - 1 for p in prompts)
    assert server.wait_until(lambda: per_engine({"0": server.get("/metrics").text},
                                                "fleet:kv_transfer_tokens_total").get("1") == transferred)
    pages = {"0": server.get("/metrics").text}
    assert per_engine(pages, "fleet:generation_tokens_total")["1"] == len(prompts) * MAX_TOKENS
    assert per_engine(pages, "fleet:generation_tokens_total")["0"] == len(prompts)  # one dropped token each
    assert per_engine(pages, "fleet:kv_transfer_failures_total")["1"] == 0


def test_one_launch_computes_short_prompts_on_the_decode_replica(disaggregated, tiny_llama_dir):
    from fleet.tests.parallel.dp_helpers import per_engine

    server = disaggregated
    before = per_engine({"0": server.get("/metrics").text}, "fleet:generation_tokens_total")
    prompts = random_prompts(2, 512, seed=8, max_len=7)  # under min_prompt_tokens=8
    texts = [complete(server.url, prompt) for prompt in prompts]
    assert [t.strip("\ufffd") for t in texts] == expected(server, tiny_llama_dir, prompts)
    after = per_engine({"0": server.get("/metrics").text}, "fleet:generation_tokens_total")
    assert after["0"] == before["0"] and after["1"] == before["1"] + 2 * MAX_TOKENS


def test_one_launch_serves_on_while_its_prefill_replica_is_dead(disaggregated, tiny_llama_dir):
    server = disaggregated
    (engine,) = server.children_named("fleet-engine-dp0")
    engine.kill()
    prompts = [p for p in random_prompts(8, 512, seed=7, max_len=40) if len(p) >= 8][:4]
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(server.url, p, stream=True), prompts))
    assert [t.strip("\ufffd") for t in texts] == expected(server, tiny_llama_dir, prompts)
    assert any("the decode replica computes a prompt itself" in line for line in server.log)
    assert server.wait_until(lambda: server.get("/health?verbose").json()["replicas"][0]["state"] == "up", 60)
    server.refresh_descendants()
