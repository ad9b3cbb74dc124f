"""Suite-wide fixtures: tiny random-weight models (see tests/tiny_models.py)."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from fleet.tests.tiny_models import MOE_DIMS, write_tiny_gemma3_multimodal, write_tiny_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Llama with GQA (4 query heads, 2 KV heads), untied embeddings."""
    return os.fspath(write_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama", seed=0))


@pytest.fixture(scope="session")
def tiny_cycling_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny Llama with its attention output scaled by 0.01: greedy text soon repeats itself."""
    directory = tmp_path_factory.mktemp("tiny_cycling_llama")
    return os.fspath(write_tiny_model(directory, "llama", seed=0, attention_output_scale=0.01))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2 with GQA, q/k/v biases and tied embeddings."""
    directory = tmp_path_factory.mktemp("tiny_qwen2")
    return os.fspath(write_tiny_model(directory, "qwen2", seed=1, tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_bf16_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The Qwen2 above (biases, tied embeddings), saved in bfloat16."""
    directory = tmp_path_factory.mktemp("tiny_bf16_qwen2")
    return os.fspath(write_tiny_model(directory, "qwen2", seed=1, dtype=torch.bfloat16, tie_word_embeddings=True))


@pytest.fixture(scope="session")
def tiny_mixtral_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Mixtral: 8 experts, top-2 routing, GQA."""
    directory = tmp_path_factory.mktemp("tiny_mixtral")
    return os.fspath(write_tiny_model(directory, "mixtral", seed=2, num_local_experts=8, **MOE_DIMS))


@pytest.fixture(scope="session")
def tiny_qwen2_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen2-MoE: 8 routed experts (top-2) plus a gated shared expert, q/k/v biases."""
    directory = tmp_path_factory.mktemp("tiny_qwen2_moe")
    return os.fspath(write_tiny_model(
        directory, "qwen2_moe", seed=3, num_experts=8, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, tie_word_embeddings=True, **MOE_DIMS,
    ))



@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3: per-head q/k norms, head_dim 32 (not hidden / heads = 16), q/k/v and o biases."""
    directory = tmp_path_factory.mktemp("tiny_qwen3")
    return os.fspath(write_tiny_model(directory, "qwen3", seed=4, head_dim=32, attention_bias=True))


@pytest.fixture(scope="session")
def tiny_qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3-MoE: Qwen3's attention, 8 routed experts (top-2, renormalised), layer 1 dense."""
    directory = tmp_path_factory.mktemp("tiny_qwen3_moe")
    return os.fspath(write_tiny_model(directory, "qwen3_moe", seed=5, head_dim=32, num_experts=8,
                                      moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1], **MOE_DIMS))


@pytest.fixture(scope="session")
def tiny_phi3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Phi-3 (fused qkv_proj and gate_up_proj in the checkpoint) with Phi-4-mini's partial rotary (half of
    each head turns) and Phi-3-128k's LongRoPE (prompts stay within its original 512 positions: short factors)."""
    directory = tmp_path_factory.mktemp("tiny_phi3")
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.7, 2.2], "long_factor": [3.0, 5.0, 7.0, 9.0]}
    return os.fspath(write_tiny_model(directory, "phi3", seed=6, pad_token_id=0, original_max_position_embeddings=512,
                                      rope_parameters=rope))


SLIDING_WINDOW = 8
"""The tiny sliding-window models' window: every test prompt reaches past it."""


@pytest.fixture(scope="session")
def tiny_mistral_swa_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Mistral v0.1's shape: every layer attends over a sliding window (of 8 tokens here)."""
    directory = tmp_path_factory.mktemp("tiny_mistral_swa")
    return os.fspath(write_tiny_model(directory, "mistral", seed=7, sliding_window=SLIDING_WINDOW))


@pytest.fixture(scope="session")
def tiny_qwen3_swa_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Qwen3 with use_sliding_window: layers 2 and 3 slide (from max_window_layers up), 0 and 1 see everything."""
    directory = tmp_path_factory.mktemp("tiny_qwen3_swa")
    return os.fspath(write_tiny_model(directory, "qwen3", seed=8, head_dim=32, use_sliding_window=True,
                                      sliding_window=SLIDING_WINDOW, max_window_layers=2))


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Gemma 3: local layers over a window of 8 with rope base 10,000, every third layer global with base
    1,000,000 and linear rope scaling; head_dim 32, query_pre_attn_scalar 24, GeGLU, four norms a layer."""
    directory = tmp_path_factory.mktemp("tiny_gemma3")
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0}}
    return os.fspath(write_tiny_model(directory, "gemma3", seed=9, head_dim=32, query_pre_attn_scalar=24,
                                      sliding_window=SLIDING_WINDOW, pad_token_id=0, rope_parameters=rope,
                                      layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                   "sliding_attention"]))


@pytest.fixture(scope="session")
def tiny_gemma3_multimodal_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Gemma 3 as 4B and larger ship it: an image-text checkpoint, of which fleet serves the language model."""
    directory = tmp_path_factory.mktemp("tiny_gemma3_multimodal")
    return os.fspath(write_tiny_gemma3_multimodal(directory, seed=10, head_dim=32, sliding_window=SLIDING_WINDOW,
                                                  pad_token_id=0))

HERMES_TEMPLATE = (
    "{% if tools %}<s>system\nTools:{% for tool in tools %} {{ tool['function']['name'] }}"
    "{{ tool['function']['parameters'] | tojson }}{% endfor %}</s>\n{% endif %}"
    "{% for message in messages %}<s>{{ message['role'] }}\n"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}<tool_call>"
    "{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}</tool_call>{% endfor %}{% endif %}"
    "{% if message['tool_call_id'] is defined %}[{{ message['tool_call_id'] }}] {% endif %}"
    "{{ message['content'] }}</s>\n{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
"""A small Hermes-style template that shows tools, calls and tool results (the tiny model's own shows none)."""


@pytest.fixture(scope="session")
def tool_model_dir(tiny_llama_dir, tmp_path_factory) -> str:
    """The tiny Llama with HERMES_TEMPLATE as its chat template."""
    path = tmp_path_factory.mktemp("tiny-llama-tools")
    for item in Path(tiny_llama_dir).iterdir():
        if item.name != "tokenizer_config.json":
            (path / item.name).symlink_to(item)
    config = json.loads((Path(tiny_llama_dir) / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": HERMES_TEMPLATE}))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    return str(path)
