"""Our Llama loaded from the default SmolLM2 GGUF vs transformers loading the same file."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import default_model_path, hf_config_from_gguf
from fleet.kernels.attention import AttentionMetadata
from fleet.workers.loader import gguf_to_hf_name, load_model, unpermute_qk_rows

PROMPT = [1, 504, 3458, 282, 4235, 314, 1345, 30, 378, 2075, 28, 2640, 17, 4470, 4071, 4811, 314]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_path()
    except ValueError as error:
        pytest.skip(str(error))


@torch.inference_mode()
def test_logits_match_transformers(gguf_path: str) -> None:
    from transformers import AutoModelForCausalLM

    hf_config = hf_config_from_gguf(gguf_path)
    model_config = ModelConfig(model=gguf_path, model_path=gguf_path, architecture=hf_config["architectures"][0],
                               hf_config=hf_config)
    ours = load_model(model_config, LoadConfig(load_format="gguf"), torch.float32, torch.device("cpu"))
    block_size, num_tokens = 16, len(PROMPT)
    kv_caches = [torch.zeros(2, 4, block_size, ours.num_kv_heads, ours.head_dim) for _ in range(ours.num_layers)]
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[2, 1]], block_size)
    hidden = ours(torch.tensor(PROMPT), torch.arange(num_tokens), kv_caches, meta)
    logits = ours.compute_logits(hidden)  # [T, vocab]

    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32
    ).eval()
    expected = hf(torch.tensor([PROMPT])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    assert logits[-1].argmax() == expected[-1].argmax()


def test_name_mapping() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.3.unknown.weight") is None


def test_unpermute_inverts_llama_cpp_permute() -> None:
    num_heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(num_heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
    permuted = weight.reshape(num_heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_qk_rows(permuted, num_heads), weight)


def test_fleet_prepare_keeps_the_dequantised_weights_and_tokenizer(gguf_path: str, tmp_path) -> None:
    """`fleet prepare` (what `make install` runs) leaves in fleet's cache exactly
    the weights a direct dequantisation gives, and the converted tokenizer,
    so that the first launch reads them instead of parsing the GGUF file."""
    from safetensors import safe_open

    from fleet.workers.loader import _gguf_weights

    cache = tmp_path / "fleet-cache"
    done = subprocess.run(
        [sys.executable, "-P", "-m", "fleet.frontend.cli", "prepare", "--dtype", "float32", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "FLEET_CACHE_DIR": str(cache)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((cache / "gguf-tokenizer").glob("*/tokenizer_config.json"))
    (kept,) = (cache / "gguf-weights-float32").glob("*.safetensors")
    with safe_open(kept, framework="pt") as weights:
        names = set(weights.keys())  # noqa: SIM118 (safe_open is not a dict)
        for name, expected in _gguf_weights(gguf_path):
            assert torch.equal(weights.get_tensor(name), expected), name
            names.remove(name)
    assert not names
