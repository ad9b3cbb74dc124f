"""Rotary position embedding (neox style: rotate halves, as HF Llama does):
torch-native version (CPU, and the oracle for the Triton kernel)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fleet.kernels.attention import triton_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of an HF config: {"rope_type", "rope_theta", ...}.

    transformers 5 writes `rope_parameters`; older configs (and GGUF-derived
    ones) have `rope_theta` plus an optional `rope_scaling` dict.
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {params['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return params


def inverse_frequencies(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """float32 [head_dim // 2], computed exactly as transformers does."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if params["rope_type"] == "linear":
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, params)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: low frequencies slowed by `factor`, high ones kept, a smooth ramp between."""
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos of each angle, then sin (halves)."""
    angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def apply_rotary(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query [T, H, D] and key [T, KVH, D] by their tokens' positions
    [T]. On CUDA (Triton) in place: the callers pass views of the QKV
    projection's fresh output."""
    triton = triton_kernels(query, key)
    if triton is not None:
        return triton.rotate_(query, positions, cache), triton.rotate_(key, positions, cache)
    cos, sin = cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)  # each [T, 1, D/2]
    return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Same products and sums as HF's x * cos + rotate_half(x) * sin.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(nn.Module):
    """Holds the cos/sin cache (a buffer, so it follows the model's device)."""

    def __init__(self, head_dim: int, max_positions: int, hf_config: dict[str, Any], dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, rope_parameters(hf_config))
        cache = cos_sin_cache(inv_freq, max_positions).to(device=device, dtype=dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_positions, head_dim]

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary(positions, query, key, self.cos_sin_cache)
