"""Mixtral: Llama's attention and decoder with every MLP a sparse mixture of
experts (softmax router, top-k, the k weights renormalised).

Sliding-window attention is not implemented: a config whose window is
shorter than its context is refused.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fleet.parallel.moe import FusedMoE, ReplicatedLinear, check_experts_loaded, expert_param_name
from fleet.workers.models.llama import LlamaForCausalLM, LlamaSpec


@dataclass(frozen=True)
class MoeSpec(LlamaSpec):
    """LlamaSpec plus the facts of the sparse MLP blocks."""

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    """Each routed expert's intermediate size."""
    renormalize: bool
    """Whether a token's k routing weights are rescaled to sum to 1."""


def moe_spec(spec: LlamaSpec, **moe_facts: Any) -> MoeSpec:
    return MoeSpec(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}, **moe_facts)


class SparseMoeBlock(nn.Module):
    """Router (replicated) and experts (split over ranks by FusedMoE)."""

    def __init__(self, spec: MoeSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(spec.hidden_size, spec.num_experts, dtype=dtype, device=device)
        self.experts = FusedMoE(spec.num_experts, spec.top_k, spec.hidden_size, spec.moe_intermediate_size,
                                spec.renormalize, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))  # [T, hidden], router logits [T, E]


class MixtralForCausalLM(LlamaForCausalLM):
    spec: MoeSpec

    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> MoeSpec:
        return moe_spec(
            super().spec_from_config(hf_config),
            num_experts=hf_config["num_local_experts"],
            top_k=hf_config["num_experts_per_tok"],
            moe_intermediate_size=hf_config["intermediate_size"],
            renormalize=True,
        )

    def build_mlp(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        return SparseMoeBlock(self.spec, dtype, device)

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        hf_name = hf_name.replace(".block_sparse_moe.", ".mlp.")
        return expert_param_name(hf_name) or super().param_name(hf_name)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(weights)
        check_experts_loaded(self)
