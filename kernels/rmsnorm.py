"""RMSNorm: torch-native version (the oracle for the Triton kernel), on CPU
tensors the fused C++ kernels (kernels/csrc/elementwise_cpu.cpp, same numerics)
unless `attention.set_cpu_kernels_enabled(False)`, on CUDA tensors the Triton
kernels (kernels/triton_ops.py)."""
from __future__ import annotations

import torch

from fleet.kernels.attention import elementwise_cpu_ops, triton_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim.

    Statistics in float32 whatever x's dtype (as HF Llama does), so bf16 runs
    stay close to the float32 oracle.
    """
    ops = elementwise_cpu_ops(x, weight) or triton_kernels(x, weight)
    if ops is not None:
        return ops.rms_norm(x, weight, eps)
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the residual, then normalise: returns (normed, new_residual).

    The sum is taken in x's dtype, as HF's decoder layers do. Neither input is
    modified: new_residual is a new tensor.
    """
    ops = elementwise_cpu_ops(x, residual, weight) or triton_kernels(x, residual, weight)
    if ops is not None and x.shape == residual.shape:
        return ops.fused_add_rms_norm(x, residual, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
