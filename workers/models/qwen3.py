"""Qwen3: Llama's architecture with an RMSNorm over each query and key head
(q_norm, k_norm: weights of head_dim, applied before the rotary embedding),
an explicit head_dim, and attention_bias on q/k/v and o_proj alike.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from fleet.workers.models.llama import LlamaForCausalLM, LlamaSpec


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> LlamaSpec:
        return dataclasses.replace(super().spec_from_config(hf_config), qk_norm=True)
