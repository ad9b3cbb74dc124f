"""Qwen2-MoE: Qwen2's attention (q/k/v biases) with sparse MLP blocks: routed
experts (softmax, top-k, renormalised only with norm_topk_prob) plus a shared
expert scaled by sigmoid(shared_expert_gate(x)).

Layer i is sparse unless it is in `mlp_only_layers` or (i + 1) is not a
multiple of `decoder_sparse_step`; a dense layer has a plain MLP of
`intermediate_size`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from fleet.parallel.moe import ReplicatedLinear, check_experts_loaded, expert_param_name
from fleet.workers.models.llama import LlamaMLP
from fleet.workers.models.mixtral import MoeSpec, SparseMoeBlock, moe_spec
from fleet.workers.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeSparseBlock(SparseMoeBlock):
    def __init__(self, spec: MoeSpec, shared_intermediate_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__(spec, dtype, device)
        shared = dataclasses.replace(spec, intermediate_size=shared_intermediate_size)
        self.shared_expert = LlamaMLP(shared, dtype, device)  # tensor parallel, like a dense MLP
        self.shared_expert_gate = ReplicatedLinear(spec.hidden_size, 1, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)  # [T, 1] * [T, hidden]
        return super().forward(x) + shared


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    spec: MoeSpec

    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> MoeSpec:
        spec = super().spec_from_config(hf_config)
        return moe_spec(
            dataclasses.replace(spec, qkv_bias=bool(hf_config.get("qkv_bias", True))),
            num_experts=hf_config.get("num_experts") or hf_config["num_local_experts"],  # transformers 5 writes the latter
            top_k=hf_config["num_experts_per_tok"],
            moe_intermediate_size=hf_config["moe_intermediate_size"],
            renormalize=bool(hf_config.get("norm_topk_prob", False)),
        )

    def is_sparse(self, layer: int) -> bool:
        config = self.spec.hf_config
        step = config.get("decoder_sparse_step", 1)
        return (layer not in (config.get("mlp_only_layers") or []) and self.spec.num_experts > 0
                and step > 0 and (layer + 1) % step == 0)

    def build_mlp(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        if not self.is_sparse(layer):
            return LlamaMLP(self.spec, dtype, device)
        shared_size = self.spec.hf_config["shared_expert_intermediate_size"]
        return Qwen2MoeSparseBlock(self.spec, shared_size, dtype, device)

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        return expert_param_name(hf_name) or super().param_name(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(weights)
        check_experts_loaded(self)
