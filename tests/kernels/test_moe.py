"""fused_moe and select_experts against a naive per-token, per-expert loop in float64."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fleet.kernels.moe import fused_moe, select_experts

H, INTER, E, K = 32, 24, 8, 2  # hidden, expert intermediate, experts, experts per token
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def naive_moe(hidden, w13, w2, weights, ids, expert_offset):
    """Every token, every routed slot, in float64: the definition."""
    hidden, w13, w2 = hidden.double(), w13.double(), w2.double()
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for slot in range(ids.shape[1]):
            local = int(ids[t, slot]) - expert_offset
            if not 0 <= local < w13.shape[0]:
                continue
            gate, up = (w13[local] @ hidden[t]).chunk(2)
            out[t] += float(weights[t, slot]) * (w2[local] @ (F.silu(gate) * up))
    return out


def _case(num_tokens: int, num_local: int, dtype: torch.dtype, seed: int):
    hidden = _randn(num_tokens, H, seed=seed).to(dtype)
    w13 = _randn(num_local, 2 * INTER, H, seed=seed + 1, scale=0.2).to(dtype)
    w2 = _randn(num_local, H, INTER, seed=seed + 2, scale=0.2).to(dtype)
    weights, ids = select_experts(_randn(num_tokens, E, seed=seed + 3), K, renormalize=True)
    return hidden, w13, w2, weights, ids


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_all_experts_local(dtype, num_tokens):
    hidden, w13, w2, weights, ids = _case(num_tokens, E, dtype, seed=num_tokens)
    got = fused_moe(hidden, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == (num_tokens, H)
    want = naive_moe(hidden, w13, w2, weights, ids, 0)
    torch.testing.assert_close(got.double(), want, rtol=TOLERANCE[dtype], atol=TOLERANCE[dtype])


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_expert_parallel_slices_sum_to_the_whole(num_ranks):
    hidden, w13, w2, weights, ids = _case(40, E, torch.float32, seed=7)
    per_rank = E // num_ranks
    parts = []
    for rank in range(num_ranks):
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        part = fused_moe(hidden, w13[local], w2[local], weights, ids, expert_offset=rank * per_rank)
        torch.testing.assert_close(part.double(), naive_moe(hidden, w13[local], w2[local], weights, ids,
                                                             rank * per_rank), rtol=1e-5, atol=1e-5)
        parts.append(part)
    torch.testing.assert_close(sum(parts), fused_moe(hidden, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_tensor_parallel_slices_sum_to_the_whole():
    """Splitting every expert's intermediate dim (gate/up rows, down columns) gives partial sums."""
    hidden, w13, w2, weights, ids = _case(30, E, torch.float32, seed=11)
    half = INTER // 2
    parts = []
    for rank in range(2):
        own = torch.arange(rank * half, (rank + 1) * half)
        rows = torch.cat([own, INTER + own])  # this rank's gate rows and up rows
        parts.append(fused_moe(hidden, w13[:, rows], w2[:, :, rank * half : (rank + 1) * half], weights, ids))
    torch.testing.assert_close(parts[0] + parts[1], fused_moe(hidden, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_no_local_expert_routed_gives_zeros():
    hidden, w13, w2, weights, ids = _case(6, 2, torch.float32, seed=3)
    ids = torch.full_like(ids, 7)  # every token to expert 7; this rank holds experts 0 and 1
    assert torch.equal(fused_moe(hidden, w13, w2, weights, ids), torch.zeros(6, H))


@pytest.mark.parametrize("dtype", list(TOLERANCE))
def test_zero_tokens(dtype):
    hidden, w13, w2, weights, ids = _case(0, 4, dtype, seed=0)
    got = fused_moe(hidden, w13, w2, weights, ids, expert_offset=4)
    assert got.shape == (0, H) and got.dtype == dtype


def test_select_experts():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    probs = torch.softmax(logits, dim=-1)
    weights, ids = select_experts(logits.bfloat16(), 2, renormalize=False)
    assert weights.dtype == torch.float32 and ids.tolist() == [[1, 2], [3, 0]]
    weights, ids = select_experts(logits, 2, renormalize=False)
    torch.testing.assert_close(weights, torch.stack([probs[0, [1, 2]], probs[1, [3, 0]]]))
    weights, _ = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2))
    torch.testing.assert_close(weights[:, 0] / weights[:, 1], torch.stack([probs[0, 1] / probs[0, 2],
                                                                          probs[1, 3] / probs[1, 0]]))
