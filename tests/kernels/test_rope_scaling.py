"""Every rope scaling fleet serves gives the cos/sin transformers computes:
its own rope init functions and attention scaling are the oracle (default,
linear, llama3, dynamic within the context, YaRN with and without mscale,
LongRoPE's short and long factors), partial rotary included."""
from __future__ import annotations

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from fleet.kernels.rotary import RotaryEmbedding

HEAD_DIM, ORIGINAL, CONTEXT = 32, 256, 1024

SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16, "beta_slow": 2},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(HEAD_DIM // 4)],
                 "long_factor": [2.0 + 0.3 * i for i in range(HEAD_DIM // 4)]},
}
"""LongRoPE with partial_rotary_factor 0.5: factors for 16 rotated dimensions."""


def hf_cos_sin(config, seq_len: int | None) -> torch.Tensor:
    """transformers' [positions, rotary dim] table at a sequence length: cos then sin, scaled."""
    kind = config.rope_parameters["rope_type"]
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=seq_len) if kind != "default" else (
        1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)), 1.0)
    angles = torch.arange(CONTEXT).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1) * scaling


@pytest.mark.parametrize("name", SCALINGS)
def test_cos_sin_match_transformers(name):
    partial = 0.5 if name == "longrope" else 1.0
    rope = {"rope_theta": 10000.0, "partial_rotary_factor": partial, **SCALINGS[name]}
    if name == "longrope":  # Phi-3's: its config holds the original context
        config = transformers.Phi3Config(hidden_size=HEAD_DIM * 4, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=CONTEXT, original_max_position_embeddings=ORIGINAL,
                                         rope_parameters=rope)
    else:
        config = transformers.LlamaConfig(hidden_size=HEAD_DIM * 4, num_attention_heads=4, head_dim=HEAD_DIM,
                                          max_position_embeddings=CONTEXT, rope_parameters=rope)
    ours = RotaryEmbedding(HEAD_DIM, CONTEXT, config.to_dict(), torch.float32, "cpu")
    assert ours.rotary_dim == int(HEAD_DIM * partial)
    within = hf_cos_sin(config, seq_len=ORIGINAL)  # a sequence within the original context
    torch.testing.assert_close(ours.cos_sin_cache[:ORIGINAL], within[:ORIGINAL], atol=1e-6, rtol=1e-6)
    if name == "longrope":  # later positions: the long factors, as transformers takes them for a long sequence
        torch.testing.assert_close(ours.cos_sin_cache[ORIGINAL:], hf_cos_sin(config, CONTEXT)[ORIGINAL:],
                                   atol=1e-6, rtol=1e-6)
    elif name != "dynamic":  # dynamic NTK grows only past the model's context, where fleet serves nothing
        torch.testing.assert_close(ours.cos_sin_cache, within, atol=1e-6, rtol=1e-6)


def test_partial_rotary_turns_only_the_first_dimensions():
    config = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    ours = RotaryEmbedding(HEAD_DIM, 64, config, torch.float32, "cpu")
    query, key = torch.randn(5, 4, HEAD_DIM), torch.randn(5, 2, HEAD_DIM)
    positions = torch.tensor([0, 3, 9, 20, 63])
    q, k = ours(positions, query, key)
    assert torch.equal(q[..., HEAD_DIM // 2:], query[..., HEAD_DIM // 2:])
    assert torch.equal(k[..., HEAD_DIM // 2:], key[..., HEAD_DIM // 2:])
    assert torch.equal(q[0], query[0]) and not torch.allclose(q[1, :, : HEAD_DIM // 2], query[1, :, : HEAD_DIM // 2])
