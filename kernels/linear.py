"""The matmul of every linear layer, and the bfloat16 copy of its weight
that steps of few rows use on a CPU.

A decode step of a few sequences does little arithmetic per weight and
streams every weight from memory once: it costs what the weights weigh. A
float32 model from a bfloat16 checkpoint (ModelConfig.keeps_bfloat16_decode_weights,
chosen on CPUs that only emulate bfloat16 arithmetic) keeps an exact bfloat16
copy of each linear weight beside the float32 one; steps of up to
DECODE_ROWS rows multiply it in `csrc/linear_bf16_weight_cpu.cpp`, widening
to float32 as they go, at half the bytes. Larger steps (prefill) are
compute-bound and stay with the float32 GEMM.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fleet.kernels.cpu_extension import cpu_kernels

DECODE_ROWS = 8
"""Most rows the bfloat16 copy serves: measured on a 2-core AVX-512 Xeon
(SmolLM2's shapes), it is 1.5-2x faster than float32 MKL at 1-2 rows, level
at 16 and 2x slower at 32 (scripts/bench_linear.py)."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           decode_weight: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out]: F.linear, or the bfloat16 copy for a few rows."""
    if decode_weight is not None and x.dim() == 2 and x.shape[0] <= DECODE_ROWS:
        ops = cpu_kernels()
        if ops is not None:
            return ops.linear_bf16_weight(x.contiguous(), decode_weight, bias)
    return F.linear(x, weight, bias)


def keep_bfloat16_decode_weights(model: torch.nn.Module) -> int:
    """Give every layer that takes one (a `decode_weight` attribute) the
    bfloat16 copy of its float32 weight; returns the bytes added."""
    added = 0
    for module in model.modules():
        if hasattr(module, "decode_weight") and module.weight.dtype == torch.float32:
            module.decode_weight = module.weight.detach().to(torch.bfloat16)
            added += module.decode_weight.nbytes
    return added
