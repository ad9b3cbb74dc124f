"""Qwen2: Llama's architecture with biases on the q/k/v projections (not on o_proj).

Sliding-window attention (`use_sliding_window`, off in released Qwen2
checkpoints) is not implemented.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from fleet.workers.models.llama import LlamaForCausalLM, LlamaSpec


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> LlamaSpec:
        if hf_config.get("use_sliding_window"):
            raise ValueError("Qwen2 with use_sliding_window=true is not supported")
        return dataclasses.replace(super().spec_from_config(hf_config), qkv_bias=True, o_bias=False)
