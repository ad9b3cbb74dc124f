"""Mixture of experts: top-k routing and the experts' SwiGLU MLPs, torch-native
(the CPU path, and the oracle for the Triton kernel that CUDA tensors take,
kernels/triton_ops.py).

Abbreviations: T tokens, H hidden size, E experts (E_local of them on this
rank), I an expert's intermediate size (on this rank), k experts per token.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fleet.kernels.activation import silu_and_mul
from fleet.kernels.attention import triton_kernels


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the router logits [T, E], then the k most probable experts.

    Returns (weights float32 [T, k], expert ids int64 [T, k]); with
    `renormalize` the k weights of a token sum to 1 (Mixtral; Qwen2-MoE's
    norm_topk_prob), else they keep their softmax probabilities.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """sum over a token's routed experts of weight * down(silu(gate(x)) * up(x)).

    Args:
        hidden: [T, H] in the model's dtype.
        w13: [E_local, 2I, H], each expert's gate rows then its up rows.
        w2: [E_local, H, I], each expert's down projection.
        topk_weights: [T, k] routing weights (float32).
        topk_ids: [T, k] global expert ids.
        expert_offset: global id of local expert 0. Tokens routed to experts
            outside [expert_offset, expert_offset + E_local) get nothing from
            them here: another rank adds those (expert parallel).

    Returns:
        [T, H] in hidden's dtype, accumulated in float32.
    """
    triton = triton_kernels(hidden, w13, w2)
    if triton is not None:  # CUDA: grouped GEMMs with no host sync
        return triton.fused_moe(hidden, w13, w2, topk_weights, topk_ids, expert_offset)
    num_tokens, num_local = hidden.shape[0], w13.shape[0]
    out = torch.zeros(num_tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)  # [T, H]
    if num_tokens == 0:
        return out.to(hidden.dtype)
    top_k = topk_ids.shape[1]
    local_ids = topk_ids.reshape(-1) - expert_offset  # [T*k]
    is_local = (local_ids >= 0) & (local_ids < num_local)
    # Group the local (token, slot) pairs by expert: one gather and two matmuls per expert.
    pairs = torch.nonzero(is_local).squeeze(1)  # [P] indices into the flattened [T*k]
    pairs = pairs[torch.argsort(local_ids[pairs], stable=True)]
    counts = torch.bincount(local_ids[pairs], minlength=num_local).tolist()  # [E_local]
    flat_weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        chosen = pairs[start : start + count]  # [n]
        start += count
        tokens = chosen // top_k  # [n]
        x = hidden[tokens]  # [n, H]
        y = F.linear(silu_and_mul(F.linear(x, w13[expert])), w2[expert])  # [n, 2I] -> [n, I] -> [n, H]
        out.index_add_(0, tokens, y.float() * flat_weights[chosen, None])
    return out.to(hidden.dtype)
