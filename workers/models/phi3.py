"""Phi-3 and Phi-4-mini: Llama's architecture with the q/k/v projections
fused into one `qkv_proj` and gate/up into one `gate_up_proj` in the
checkpoint, a rotary embedding that may turn only part of each head
(partial_rotary_factor) and LongRoPE scaling (kernels/rotary.py)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from fleet.workers.models.llama import LlamaForCausalLM, LlamaSpec


class Phi3ForCausalLM(LlamaForCausalLM):
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        super().load_weights(self._unfused(weights))

    def _unfused(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The checkpoint's fused projections as Llama's separate ones, so that
        each part is split over the tensor-parallel ranks as Llama's are."""
        spec: LlamaSpec = self.spec
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        for name, weight in weights:
            if ".self_attn.qkv_proj." in name:
                bounds = {"q_proj": (0, q_size), "k_proj": (q_size, q_size + kv_size),
                          "v_proj": (q_size + kv_size, q_size + 2 * kv_size)}
                for part, (start, end) in bounds.items():
                    yield name.replace("qkv_proj", part), weight[start:end]
            elif ".mlp.gate_up_proj." in name:
                size = spec.intermediate_size
                yield name.replace("gate_up_proj", "gate_proj"), weight[:size]
                yield name.replace("gate_up_proj", "up_proj"), weight[size : 2 * size]
            else:
                yield name, weight
