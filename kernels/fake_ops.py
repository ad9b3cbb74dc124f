"""Fake (meta) implementations of the C++ CPU ops in `torch.ops.fleet_cpu`.

torch.compile traces the model with fake tensors (shapes and dtypes, no
data); an op defined in C++ needs a Python function that says what it
returns without computing it. Each one below mirrors the shape and dtype
contract of its kernel in kernels/csrc/ (the kernels allocate contiguous
outputs). `register()` is called once the library is loaded, before the first
compiled call (workers/compiled_decode.py); a new op adds one function here
and one line to FAKES.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from fleet.kernels.cpu_extension import cpu_kernels

_registered = False


def _paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     kv_lens: torch.Tensor, scale: float, seq_index: torch.Tensor | None = None) -> torch.Tensor:
    return query.new_empty(query.shape)  # [R, H, D]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x.new_empty(x.shape)


def _fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return x.new_empty(x.shape), x.new_empty(x.shape)  # (normed, new residual)


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _rotary_and_cache_(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, kv_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int) -> None:
    return None  # writes qkv and kv_cache in place (the schema marks both mutated)


def _linear_bf16_weight(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                        bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def _gguf_linear(x: torch.Tensor, packed: torch.Tensor, quant_type: int, out_features: int,
                 bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], out_features))


def _gguf_rows(packed: torch.Tensor, quant_type: int, in_features: int, ids: torch.Tensor,
               dtype: torch.dtype) -> torch.Tensor:
    return packed.new_empty((ids.shape[0], in_features), dtype=dtype)


FAKES: dict[str, Callable] = {
    "paged_attention": _paged_attention,
    "rms_norm": _rms_norm,
    "fused_add_rms_norm": _fused_add_rms_norm,
    "silu_and_mul": _silu_and_mul,
    "rotary_and_cache_": _rotary_and_cache_,
    "linear_bf16_weight": _linear_bf16_weight,
    "gguf_linear": _gguf_linear,
    "gguf_rows": _gguf_rows,
}
"""Op name in the fleet_cpu namespace -> its fake implementation."""


def register() -> bool:
    """Register every fake implementation (once per process); False when
    the CPU kernels are not loaded here (nothing of theirs will be traced)."""
    global _registered
    if _registered:
        return True
    if cpu_kernels() is None:
        return False
    for name, fake in FAKES.items():
        torch.library.register_fake(f"fleet_cpu::{name}")(fake)
    _registered = True
    return True
