"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with Qwen2-MoE's sparse
layers, minus the shared expert: routed experts only (softmax, top-k,
renormalised with norm_topk_prob)."""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from fleet.workers.models.llama import LlamaMLP
from fleet.workers.models.mixtral import MoeSpec, SparseMoeBlock
from fleet.workers.models.qwen2_moe import Qwen2MoeForCausalLM


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> MoeSpec:
        spec = super().spec_from_config(hf_config)
        bias = bool(hf_config.get("attention_bias", False))
        return dataclasses.replace(spec, qkv_bias=bias, o_bias=bias, qk_norm=True)

    def build_mlp(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        if not self.is_sparse(layer):
            return LlamaMLP(self.spec, dtype, device)
        return SparseMoeBlock(self.spec, dtype, device)
