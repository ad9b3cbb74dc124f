"""Embeddings of a decoder model, offline (LLM.embed) and over HTTP
(/v1/embeddings through the openai client): the final hidden states pooled
(last token or mean, L2-normalised), compared with transformers' hidden
states; with chunked prefill (mean pooling adds up the chunks), the prefix
cache (last-token pooling reuses cached blocks), and beside generation."""
from __future__ import annotations

import base64
import struct
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoTokenizer

import fleet
from fleet.tests.engine.helpers import assert_no_fleet_processes
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

PROMPTS = [list(range(5, 105)), [7, 8, 9], list(range(200, 240))]


def oracle(model_dir: str, token_ids: list[int], pooling: str) -> torch.Tensor:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        hidden = model(torch.tensor([token_ids])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0)


def assert_close(embedding: list[float], expected: torch.Tensor) -> None:
    assert len(embedding) == expected.numel()
    assert torch.allclose(torch.tensor(embedding), expected, atol=1e-4)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_llm_embed_matches_transformers_hidden_states(tiny_llama_dir, pooling):
    # 32-token steps: the 100-token prompt is prefilled in four chunks.
    with fleet.LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory_bytes="4M", pooling_type=pooling,
                   max_num_batched_tokens=32) as llm:
        first = llm.embed(PROMPTS, use_tqdm=False)
        again = llm.embed(PROMPTS[:1], use_tqdm=False)  # last pooling: its full blocks come from the prefix cache
        for prompt, output in zip(PROMPTS, first, strict=True):  # vLLM's shape: .outputs.embedding
            assert_close(output.outputs.embedding, oracle(tiny_llama_dir, prompt, pooling))
            assert output.finished and output.prompt_token_ids == prompt
        assert_close(again[0].outputs.embedding, oracle(tiny_llama_dir, PROMPTS[0], pooling))
        assert llm.get_tokenizer().encode("hello") == AutoTokenizer.from_pretrained(tiny_llama_dir).encode("hello")
    assert_no_fleet_processes()


def test_embeddings_over_http_beside_generation(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M")
    try:
        client = server.openai_client()
        model = server.get("/v1/models").json()["data"][0]["id"]
        with ThreadPoolExecutor(2) as pool:
            generating = pool.submit(client.completions.create, model=model, prompt=PROMPTS[2], max_tokens=40,
                                     extra_body={"min_tokens": 40})
            result = client.embeddings.create(model=model, input=PROMPTS[:2])
            assert generating.result().usage.completion_tokens == 40
        for prompt, item in zip(PROMPTS[:2], result.data, strict=True):
            assert_close(item.embedding, oracle(tiny_llama_dir, prompt, "last"))
        assert result.usage.prompt_tokens == len(PROMPTS[0]) + len(PROMPTS[1])
        encoded = server.post("/v1/embeddings", json={"model": model, "input": PROMPTS[1],
                                                       "encoding_format": "base64"}).json()["data"][0]["embedding"]
        raw = base64.b64decode(encoded)
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(result.data[1].embedding, abs=1e-6)
        text = client.embeddings.create(model=model, input="hello world").data[0].embedding
        assert len(text) == len(result.data[0].embedding)
        with pytest.raises(openai.BadRequestError) as shortened:
            client.embeddings.create(model=model, input="hi", dimensions=8)
        assert shortened.value.body["param"] == "dimensions"
        with pytest.raises(openai.BadRequestError) as outside:
            client.embeddings.create(model=model, input=[[10**6]])
        assert outside.value.body["param"] == "input"
    finally:
        server.close()
    server.assert_nothing_left()
