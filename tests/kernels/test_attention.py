"""paged_attention vs dense causal attention over each whole sequence."""
from __future__ import annotations

import random

import pytest
import torch

from fleet.kernels.attention import AttentionMetadata, paged_attention, token_positions


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """q [Q, H, D] at positions context_len.., k/v [S, KVH, D] of the whole sequence -> [Q, H, D] (float64)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale  # [H, Q, S]
    query_pos = torch.arange(context_len, context_len + q.shape[0])
    scores = scores.masked_fill(torch.arange(k.shape[0])[None, :] > query_pos[:, None], float("-inf"))
    return torch.einsum("hqs,shd->qhd", scores.softmax(-1), v)


def run_case(
    seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs: (context_len, query_len) per sequence, decodes first. Returns (ours, reference)."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in seqs) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)  # garbage
    tables, full_keys, full_values = [], [], []
    for context_len, query_len in seqs:
        needed = -(-(context_len + query_len) // block_size)
        tables.append(free[:needed])
        free = free[needed:]
        full_keys.append(torch.randn(context_len + query_len, num_kv_heads, head_dim, generator=gen).to(dtype))
        full_values.append(torch.randn(context_len + query_len, num_kv_heads, head_dim, generator=gen).to(dtype))
    # Put each sequence's context where earlier steps would have written it.
    context_meta = AttentionMetadata.build([c for c, _ in seqs], [c for c, _ in seqs], tables, block_size)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0][context_meta.slot_mapping] = torch.cat([k[:c] for k, (c, _) in zip(full_keys, seqs, strict=True)])
    flat[1][context_meta.slot_mapping] = torch.cat([v[:c] for v, (c, _) in zip(full_values, seqs, strict=True)])

    meta = AttentionMetadata.build([q for _, q in seqs], [c + q for c, q in seqs], tables, block_size)
    query = torch.randn(sum(q for _, q in seqs), num_heads, head_dim, generator=gen).to(dtype)
    key = torch.cat([k[c:] for k, (c, _) in zip(full_keys, seqs, strict=True)])
    value = torch.cat([v[c:] for v, (c, _) in zip(full_values, seqs, strict=True)])
    scale = head_dim**-0.5
    ours = paged_attention(query, key, value, kv_cache, meta, scale)

    assert torch.equal(flat[0][meta.slot_mapping], key) and torch.equal(flat[1][meta.slot_mapping], value)
    queries = query.split([q for _, q in seqs])
    parts = zip(queries, full_keys, full_values, seqs, strict=True)
    reference = torch.cat([dense_reference(q, k, v, c, scale) for q, k, v, (c, _) in parts])
    return ours, reference


CASES = {
    "decodes_only": [(0, 1), (15, 1), (16, 1), (17, 1), (40, 1)],
    "prefills_only": [(0, 1), (0, 16), (0, 23)],
    "mixed": [(5, 1), (31, 1), (0, 9), (16, 16), (7, 3), (20, 1), (0, 1)],
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (6, 1)])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_matches_dense_reference(case: str, num_heads: int, num_kv_heads: int, block_size: int) -> None:
    ours, reference = run_case(CASES[case], num_heads, num_kv_heads, head_dim=32, block_size=block_size)
    assert ours.dtype == torch.float32
    torch.testing.assert_close(ours.double(), reference, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float64() -> None:
    ours, reference = run_case(CASES["mixed"], 8, 2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), reference, atol=3e-2, rtol=3e-2)


def test_metadata_layout() -> None:
    meta = AttentionMetadata.build([1, 1, 3], [5, 1, 7], [[9, 2], [4], [3, 8]], block_size=4)
    assert meta.num_decode_seqs == 2
    assert meta.query_start_loc.tolist() == [0, 1, 2, 5]
    assert meta.block_tables.tolist() == [[9, 2], [4, 0], [3, 8]]
    # positions 4 | 0 | 4, 5, 6 -> slots 2*4+0 | 4*4+0 | 8*4+0, +1, +2
    assert meta.slot_mapping.tolist() == [8, 16, 32, 33, 34]
    assert meta.slot_mapping.dtype == torch.int64 and meta.seq_lens.dtype == torch.int32
    assert token_positions([1, 1, 3], [5, 1, 7]).tolist() == [4, 0, 4, 5, 6]
