"""Prometheus metrics after known traffic: vLLM's per-request histograms
(queue, prefill, decode, inference, time per output token, prompt and
generation lengths, max_tokens and n), and prefix-cache counts that include
the steps that produced no output (a chunked prefill's first chunks)."""
from __future__ import annotations

import pytest

from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

PROMPT = list(range(5, 105))
"""100 tokens: with 32-token steps, the prefill takes four steps and only the last one samples."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--max-num-batched-tokens", "32", "--block-size", "16")
    yield server
    assert server.stop() == 0
    server.assert_nothing_left()


def test_request_histograms_and_prefix_cache_counts(server):
    model = server.get("/v1/models").json()["data"][0]["id"]
    for _ in range(2):  # the second finds the first's full blocks in the prefix cache
        body = {"model": model, "prompt": PROMPT, "max_tokens": 3, "min_tokens": 3, "temperature": 0}
        assert server.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 3
    assert server.metric("fleet:prefix_cache_queries_total") == 2 * len(PROMPT), "every lookup counted"
    assert server.metric("fleet:prefix_cache_hits_total") == 96, "the six full blocks of the first request"
    for name in ("queue_time", "prefill_time", "decode_time", "inference_time"):
        assert server.metric(f"fleet:request_{name}_seconds_count") == 2, name
        assert server.metric(f"fleet:request_{name}_seconds_sum") >= 0, name
    assert server.metric("fleet:request_decode_time_seconds_sum") > 0
    assert server.metric("fleet:time_per_output_token_seconds_count") == 2
    assert server.metric("fleet:request_prompt_tokens_sum") == 2 * len(PROMPT)
    assert server.metric("fleet:request_generation_tokens_sum") == 6
    assert server.metric("fleet:request_params_max_tokens_sum") == 6
    assert server.metric("fleet:request_params_n_count") == 2
