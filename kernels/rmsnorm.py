"""RMSNorm: torch-native version (CPU, and the oracle for the Triton kernel)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dim.

    Statistics in float32 whatever x's dtype (as HF Llama does), so bf16 runs
    stay close to the float32 oracle.
    """
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add the residual, then normalise: returns (normed, new_residual).

    The sum is taken in x's dtype, as HF's decoder layers do.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
