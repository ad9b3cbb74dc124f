"""Rotary position embedding (neox style: rotate halves, as HF Llama does):
torch-native version (CPU, and the oracle for the Triton kernel)."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from fleet.kernels.attention import triton_kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of an HF config: {"rope_type", "rope_theta", ...}.

    transformers 5 writes `rope_parameters`; older configs (and GGUF-derived
    ones) have `rope_theta` plus an optional `rope_scaling` dict.
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type") or params.get("type") or "default"
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    params.setdefault("partial_rotary_factor", hf_config.get("partial_rotary_factor", 1.0))
    params.setdefault("original_max_position_embeddings", hf_config.get("original_max_position_embeddings"))
    params.setdefault("max_position_embeddings", hf_config.get("max_position_embeddings"))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {params['rope_type']!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
    return params


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """How many of a head's dimensions are rotated (the first ones): partial_rotary_factor of them."""
    return int(head_dim * params["partial_rotary_factor"])


def inverse_frequencies(dim: int, params: dict[str, Any], factors: list[float] | None = None) -> torch.Tensor:
    """float32 [dim // 2] for `dim` rotated dimensions, computed exactly as
    transformers does. `dynamic` (NTK) changes nothing within the model's
    context, where fleet serves it; longrope takes its `factors`."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if params["rope_type"] == "linear":
        return inv_freq / params["factor"]
    if params["rope_type"] == "llama3":
        return _llama3_scaled(inv_freq, params)
    if params["rope_type"] == "yarn":
        return _yarn_scaled(dim, params)
    if params["rope_type"] == "longrope":
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * params["rope_theta"] ** exponents)
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


def _yarn_factor(params: dict[str, Any]) -> float:
    factor = params.get("factor")
    return factor if factor is not None else params["max_position_embeddings"] / params["original_max_position_embeddings"]


def _yarn_scaled(dim: int, params: dict[str, Any]) -> torch.Tensor:
    """YaRN: interpolated (slowed by `factor`) low frequencies, extrapolated high ones, a linear ramp between."""
    base, factor, original = params["rope_theta"], _yarn_factor(params), params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(params: dict[str, Any]) -> float:
    """What cos and sin are multiplied by (YaRN's and LongRoPE's temperature), as transformers computes it."""
    given = params.get("attention_factor")
    if given is not None or params["rope_type"] not in ("yarn", "longrope"):
        return 1.0 if given is None else given
    if params["rope_type"] == "yarn":
        factor, mscale, mscale_all_dim = _yarn_factor(params), params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        return _yarn_mscale(factor)
    factor = params.get("factor") or params["max_position_embeddings"] / params["original_max_position_embeddings"]
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, dim]: cos of each angle, then sin (halves)."""
    angles = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


def rope_cache(dim: int, max_positions: int, params: dict[str, Any]) -> torch.Tensor:
    """The model's cos/sin table [max_positions, dim]. LongRoPE: positions
    within the original context take the short factors, later ones the long
    ones (as vLLM; transformers switches a whole sequence once it is longer)."""
    if params["rope_type"] == "longrope":
        original = params["original_max_position_embeddings"]
        short = cos_sin_cache(inverse_frequencies(dim, params, params["short_factor"]), min(original, max_positions))
        long = cos_sin_cache(inverse_frequencies(dim, params, params["long_factor"]), max_positions)[original:]
        cache = torch.cat((short, long))
    else:
        cache = cos_sin_cache(inverse_frequencies(dim, params), max_positions)
    return cache * attention_factor(params)


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
        params = rope_parameters(hf_config)
        self.rotary_dim = rotary_dim(head_dim, params)
        self.partial = self.rotary_dim < head_dim
        cache = rope_cache(self.rotary_dim, max_positions, params).to(device=device, dtype=dtype)
        self.register_buffer("cos_sin_cache", cache, persistent=False)  # [max_positions, rotary_dim]

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.partial:
            return apply_rotary(positions, query, key, self.cos_sin_cache)
        # Only the first rotary_dim dimensions of each head turn (Phi-4-mini): torch's path, on copies.
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
        dim = self.rotary_dim
        return tuple(torch.cat((_rotate(x[..., :dim], cos, sin), x[..., dim:]), dim=-1) for x in (query, key))
