"""Gemma 3 (text): Llama's parts arranged Gemma's way.

- Embeddings scaled by sqrt(hidden_size) (rounded to the model's dtype, as transformers does).
- RMSNorms multiply by (1 + w): the checkpoint's w is loaded as 1 + w, so the shared kernel applies.
- Each layer normalises before and after its attention and its MLP (four norms), and its
  attention normalises each query and key head (q_norm, k_norm) and scales by
  query_pre_attn_scalar ** -0.5.
- The MLP is GeGLU: gelu(gate, tanh approximation) * up.
- Local layers attend over a sliding window with their own rope base; global layers see
  everything with the global rope (and its scaling): `layer_types` says which.
- Final logits soft-capped by `final_logit_softcapping` when set (Gemma 2's; Gemma 3 sets none).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleet.config.model import layer_types
from fleet.kernels.attention import AttentionMetadata
from fleet.kernels.rotary import RotaryEmbedding
from fleet.parallel.layers import MergedColumnParallelLinear, RowParallelLinear
from fleet.workers.models.llama import LlamaAttention, LlamaForCausalLM, LlamaSpec, RMSNorm, take_stage

LOCAL, GLOBAL = "sliding_attention", "full_attention"


def gemma_layer_types(hf_config: dict[str, Any]) -> list[str]:
    """Each layer's kind; a config that says nothing has Gemma 3's pattern (5 local, then 1 global)."""
    return layer_types({"sliding_window_pattern": 6, **hf_config}) or []


def rope_configs(hf_config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The rope settings of each layer kind, as a config RotaryEmbedding reads: transformers 5 writes
    them per kind in `rope_parameters`; older configs have rope_theta (and rope_scaling) for the global
    layers and rope_local_base_freq for the local ones."""
    params = hf_config.get("rope_parameters") or {}
    if LOCAL in params and GLOBAL in params:
        return {kind: {"rope_parameters": dict(params[kind])} for kind in (LOCAL, GLOBAL)}
    global_params = {**(hf_config.get("rope_scaling") or {}), "rope_theta": hf_config.get("rope_theta", 1_000_000.0)}
    local_params = {"rope_type": "default", "rope_theta": hf_config.get("rope_local_base_freq", 10_000.0)}
    return {LOCAL: {"rope_parameters": local_params}, GLOBAL: {"rope_parameters": global_params}}


class GemmaMLP(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [size, size], bias=False, dtype=dtype,
                                                       device=device)
        self.down_proj = RowParallelLinear(size, spec.hidden_size, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str, window: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, dtype, device, window)
        self.self_attn.scale = spec.hf_config.get("query_pre_attn_scalar", spec.head_dim) ** -0.5
        self.mlp = GemmaMLP(spec, dtype, device)
        size, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(size, eps, dtype, device)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, dtype, device)
        self.post_feedforward_layernorm = RMSNorm(size, eps, dtype, device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        attended = self.self_attn(positions, self.input_layernorm(hidden), rotary, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    """The decoder stack, or this pipeline stage's part of it. Between stages the
    intermediate is [2, T, hidden] as for Llama: the residual stream and zeros."""

    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        take_stage(self, spec, dtype, device)
        self.embed_scale = torch.tensor(spec.hidden_size**0.5, dtype=dtype).item()  # rounded as the weights are
        self.layers = nn.ModuleDict({str(i): Gemma3DecoderLayer(spec, dtype, device, spec.sliding_windows[i])
                                     for i in self.layer_indices})
        if self.is_last_stage:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        kinds = gemma_layer_types(spec.hf_config)
        self.layer_kinds = {i: kinds[i] for i in self.layer_indices}
        self.rotaries = nn.ModuleDict({
            kind: RotaryEmbedding(spec.head_dim, spec.max_positions, config, dtype, device)
            for kind, config in rope_configs(spec.hf_config).items()
        })

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first_stage:
            hidden = self.embed_tokens(input_ids) * self.embed_scale  # [T, hidden]
        else:
            hidden = intermediate[0] + intermediate[1]
        for (index, layer), kv_cache in zip(self.layers.items(), kv_caches, strict=True):
            hidden = layer(positions, hidden, self.rotaries[self.layer_kinds[int(index)]], kv_cache, meta)
        if not self.is_last_stage:
            return torch.stack((hidden, torch.zeros_like(hidden)))
        return self.norm(hidden)


class Gemma3ForCausalLM(LlamaForCausalLM):
    model: Gemma3Model

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        nn.Module.__init__(self)
        self.spec = self.spec_from_config(hf_config)
        self.model = Gemma3Model(self.spec, dtype, device)
        self._init_head_and_facts(dtype, device)
        self.softcap = hf_config.get("final_logit_softcapping")

    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> LlamaSpec:
        if hf_config.get("attn_logit_softcapping"):
            raise ValueError("Gemma with attn_logit_softcapping is not supported (Gemma 3 sets none)")
        hf_config = {**hf_config, "layer_types": gemma_layer_types(hf_config)}
        spec = super().spec_from_config(hf_config)
        bias = bool(hf_config.get("attention_bias", False))
        return dataclasses.replace(spec, qkv_bias=bias, o_bias=bias, qk_norm=True,
                                   tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", True)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        if logits is None or not self.softcap:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        if self.spec.hf_config.get("norms_hold_one_plus_w"):  # a GGUF file: llama.cpp's converter added the 1
            super().load_weights(weights)
        else:
            super().load_weights(_norms_plus_one(weights))


def _norms_plus_one(weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Gemma's RMSNorms scale by (1 + w): the checkpoint's w, as the shared kernel's weight."""
    for name, weight in weights:
        if name.endswith("norm.weight"):
            weight = 1.0 + torch.as_tensor(weight[:] if not isinstance(weight, torch.Tensor) else weight).float()
        yield name, weight


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """Gemma 3 4B and larger: an image-text checkpoint, whose language model is served (text only;
    config/model_files.text_model_config flattens its config, the vision tower's weights are skipped)."""

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights((name.removeprefix("language_model."), weight) for name, weight in weights
                             if name.startswith("language_model."))
