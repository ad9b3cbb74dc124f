"""Activations: torch-native versions (the oracle for Triton kernels), on CPU
tensors the fused C++ kernel (kernels/csrc/elementwise_cpu.cpp, same
numerics) unless `attention.set_cpu_kernels_enabled(False)`, on CUDA tensors
the Triton kernel (kernels/triton_ops.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fleet.kernels.attention import elementwise_cpu_ops, triton_kernels


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a merged gate/up projection: x [..., 2*I] -> silu(gate) * up [..., I]."""
    ops = elementwise_cpu_ops(x) or triton_kernels(x)
    if ops is not None and x.shape[-1] % 2 == 0:
        return ops.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
