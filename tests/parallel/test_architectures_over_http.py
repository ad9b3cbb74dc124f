"""Each architecture added beyond Llama/Qwen2/Mixtral/Qwen2-MoE served by
`fleet launch` at tensor parallel 2: transformers' greedy tokens over HTTP,
with a KV cache small enough that requests are preempted, and prompts sent
again so that they come from the prefix cache."""
from __future__ import annotations

import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import assert_greedy_over_http

pytestmark = pytest.mark.slow


# A KV cache of about 128 tokens per worker: two or three of the 8 concurrent requests fit.
@pytest.mark.parametrize("model_fixture,kv_bytes", [("tiny_qwen3_dir", "128K"), ("tiny_qwen3_moe_dir", "128K"),
                                                    ("tiny_phi3_dir", "64K")])  # head_dim 16, not 32
def test_greedy_over_http_with_preemption_and_prefix_hits(request, model_fixture, kv_bytes):
    model_dir = str(request.getfixturevalue(model_fixture))
    server = Server(model_dir, "--tp", "2", "--dtype", "float32", "--device", "cpu",
                    "--kv-cache-memory-bytes", kv_bytes, "--max-model-len", "64")
    try:
        assert_greedy_over_http(server, model_dir, count=8, seed=30)
        assert_greedy_over_http(server, model_dir, count=8, seed=30)  # the same prompts again
        assert server.metric("fleet:num_preemptions_total") > 0
        assert server.metric("fleet:prefix_cache_hits_total") > 0
    finally:
        assert server.stop() == 0
