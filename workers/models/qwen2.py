"""Qwen2: Llama's architecture with biases on the q/k/v projections (not on o_proj).
Its sliding window (`use_sliding_window`, off in released checkpoints) is
read by llama.sliding_windows."""
from __future__ import annotations

import dataclasses
from typing import Any

from fleet.workers.models.llama import LlamaForCausalLM, LlamaSpec


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> LlamaSpec:
        return dataclasses.replace(super().spec_from_config(hf_config), qkv_bias=True, o_bias=False)
