"""The fused C++ paged-attention kernel (CPU) against the torch-native path and
a dense float64 reference. Skipped where the kernel cannot be built."""
from __future__ import annotations

import random

import pytest
import torch

from fleet.kernels import attention
from fleet.kernels.attention import AttentionMetadata, paged_attention, set_cpu_kernels_enabled

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


class PagedCache:
    """A random KV cache whose sequences own shuffled blocks; block 0 is never used (padding)."""

    def __init__(self, seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, seed: int) -> None:
        gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
        needed = [-(-n // block_size) for n in seq_lens]
        ids = list(range(1, sum(needed) + 3))
        rng.shuffle(ids)
        self.tables = []
        for count in needed:
            self.tables.append(ids[:count])
            ids = ids[count:]
        shape = (2, sum(needed) + 3, block_size, num_kv_heads, head_dim)
        self.kv_cache = torch.randn(shape, generator=gen).to(dtype)
        self.block_size = block_size

    def keys_values(self, seq: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` keys and values of sequence `seq`: [length, KVH, D] each."""
        blocks = self.kv_cache[:, self.tables[seq]].flatten(1, 2)  # [2, nb * block_size, KVH, D]
        return blocks[0, :length], blocks[1, :length]


def dense_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_lens: list[int], scale: float, window: int = 0
) -> torch.Tensor:
    """q [Q, H, D], k/v [S, KVH, D]; query i sees keys [0, kv_lens[i]) (with a window, only the last
    `window` of them) -> [Q, H, D] float64."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1).double(), v.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,shd->hqs", q.double(), k) * scale
    key_pos, lens = torch.arange(k.shape[0])[None, :], torch.tensor(kv_lens)[:, None]
    visible = key_pos < lens  # [Q, S]
    if window:
        visible &= key_pos >= lens - window
    return torch.einsum("hqs,shd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)


def decode_case(seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, seed: int = 0):
    cache = PagedCache(seq_lens, num_kv_heads, head_dim, block_size, dtype, seed)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, cache.tables, block_size)
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(seed + 1))
    query = query.to(dtype)
    scale = head_dim**-0.5
    reference = torch.cat([
        dense_reference(query[i : i + 1], *cache.keys_values(i, n), [n], scale) for i, n in enumerate(seq_lens)
    ])
    return cache, meta, query, scale, reference


def ragged_lens(block_size: int, count: int, seed: int) -> list[int]:
    """Lengths 1, block boundaries +-1, and random ones up to ~5 blocks."""
    rng = random.Random(seed)
    special = [1, block_size, block_size + 1, 2 * block_size, max(2 * block_size - 1, 1), 97]
    lens = special + [rng.randint(1, 5 * block_size + 7) for _ in range(count)]
    return lens[:count]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 128])
# Groups of 1, 3, 4 and 5 query heads: the register tiles take up to 4 (AVX-512) or 3 (AVX2) heads at a time.
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (9, 3), (8, 2), (10, 2)])
@pytest.mark.parametrize("batch", [3, 12])  # few rows: one kv head per work item; many: whole rows
def test_decode_matches_torch_and_float64(ops, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                                          block_size: int, dtype: torch.dtype) -> None:
    seq_lens = ragged_lens(block_size, batch, seed=batch + head_dim)
    cache, meta, query, scale, reference = decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype)
    fused = ops.paged_attention(query, cache.kv_cache, meta.block_tables, meta.seq_lens, scale)
    native = attention._decode_attention(query, cache.kv_cache, meta, scale)
    assert fused.dtype == dtype and fused.shape == query.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(fused.double(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(fused.double(), native.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize(("head_dim", "dtype"), [(16, torch.float32), (48, torch.float32), (80, torch.bfloat16),
                                                 (80, torch.float16), (256, torch.bfloat16), (96, torch.float16),
                                                 (64, torch.float16)])
def test_other_head_dims_and_float16(ops, head_dim: int, dtype: torch.dtype) -> None:
    seq_lens = [1, 5, 16, 33, 200]
    cache, meta, query, scale, reference = decode_case(seq_lens, 6, 2, head_dim, 16, dtype, seed=3)
    fused = ops.paged_attention(query, cache.kv_cache, meta.block_tables, meta.seq_lens, scale)
    torch.testing.assert_close(fused.double(), reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_strided_query_and_wide_tables(ops) -> None:
    """Query as a view of a fused qkv projection; block tables wider than needed."""
    seq_lens = [7, 40, 1, 64]
    cache, meta, query, scale, reference = decode_case(seq_lens, 8, 2, 64, 16, torch.float32, seed=5)
    qkv = torch.cat([query.flatten(1), torch.randn(len(seq_lens), 2 * 2 * 64)], dim=1)
    strided = qkv[:, : 8 * 64].view(len(seq_lens), 8, 64)
    assert not strided.is_contiguous()
    wide = torch.cat([meta.block_tables, torch.zeros(len(seq_lens), 5, dtype=torch.int32)], dim=1)
    fused = ops.paged_attention(strided, cache.kv_cache, wide, meta.seq_lens, scale)
    torch.testing.assert_close(fused.double(), reference, atol=1e-5, rtol=1e-5)


def test_rows_with_seq_index(ops) -> None:
    """Several query rows of one sequence, each seeing its own prefix (a causal chunk)."""
    cache, meta, _, scale, _ = decode_case([50, 20], 4, 2, 64, 16, torch.float32, seed=7)
    query = torch.randn(6, 4, 64)
    seq_index = torch.tensor([0, 0, 0, 1, 1, 0], dtype=torch.int32)
    kv_lens = torch.tensor([48, 49, 50, 1, 20, 17], dtype=torch.int32)
    fused = ops.paged_attention(query, cache.kv_cache, meta.block_tables, kv_lens, scale, seq_index)
    for row, (seq, n) in enumerate(zip(seq_index.tolist(), kv_lens.tolist(), strict=True)):
        expected = dense_reference(query[row : row + 1], *cache.keys_values(seq, n), [n], scale)
        torch.testing.assert_close(fused[row : row + 1].double(), expected, atol=1e-5, rtol=1e-5)



# (context, new tokens) per sequence: prefill chunks long enough to be cut into
# tiles of query tokens (48 // group each), with a short tail, cached context
# that ends mid-block, and a decode between them.
PREFILL_CHUNKS = [(0, 70), (37, 50), (5, 1), (100, 19), (0, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim", "block_size"),
                         [(9, 3, 64, 16), (4, 4, 64, 32), (8, 2, 128, 16), (16, 2, 80, 1), (14, 2, 64, 16)])
def test_prefill_tiles_match_float64_and_per_row_attention(ops, dtype: torch.dtype, num_heads: int,
                                                           num_kv_heads: int, head_dim: int,
                                                           block_size: int) -> None:
    """Rows of one sequence that follow each other are attended in tiles of
    query tokens; the same rows given one table row each take the per-row
    kernel. Both must match the float64 reference and each other."""
    totals = [c + n for c, n in PREFILL_CHUNKS]
    cache = PagedCache(totals, num_kv_heads, head_dim, block_size, dtype, seed=13)
    meta = AttentionMetadata.build([n for _, n in PREFILL_CHUNKS], totals, cache.tables, block_size)
    seq_index, kv_lens = meta._token_rows
    query = torch.randn(len(kv_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(14)).to(dtype)
    scale = head_dim**-0.5
    tiled = ops.paged_attention(query, cache.kv_cache, meta.block_tables, kv_lens, scale, seq_index)
    per_row = ops.paged_attention(query, cache.kv_cache, meta.block_tables[seq_index.long()].contiguous(),
                                  kv_lens, scale)
    reference = torch.cat([
        dense_reference(query[row : row + 1], *cache.keys_values(seq, n), [n], scale)
        for row, (seq, n) in enumerate(zip(seq_index.tolist(), kv_lens.tolist(), strict=True))
    ])
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(tiled.double(), reference, atol=tol, rtol=tol)
    torch.testing.assert_close(tiled.double(), per_row.double(), atol=tol, rtol=tol)


def test_prefill_tiles_keep_rows_with_nothing_to_see_at_zero(ops) -> None:
    """A row with kv_len 0 inside a tile gets zeros, as in the per-row kernel;
    its neighbours are unaffected."""
    cache, meta, _, scale, _ = decode_case([64], 9, 3, 64, 16, torch.float32, seed=17)
    kv_lens = torch.arange(16, dtype=torch.int32) * 4  # 0, 4, ..., 60
    query = torch.randn(16, 9, 64, generator=torch.Generator().manual_seed(18))
    seq_index = torch.zeros(16, dtype=torch.int32)
    out = ops.paged_attention(query, cache.kv_cache, meta.block_tables, kv_lens, scale, seq_index)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    for row in range(1, 16):
        n = int(kv_lens[row])
        expected = dense_reference(query[row : row + 1], *cache.keys_values(0, n), [n], scale)
        torch.testing.assert_close(out[row : row + 1].double(), expected, atol=1e-5, rtol=1e-5)

def test_rejects_out_of_range_blocks_and_lengths(ops) -> None:
    cache, meta, query, scale, _ = decode_case([10, 20], 4, 2, 64, 16, torch.float32)
    bad_tables = meta.block_tables.clone()
    bad_tables[1, 1] = cache.kv_cache.shape[1]
    with pytest.raises(RuntimeError, match="block id"):
        ops.paged_attention(query, cache.kv_cache, bad_tables, meta.seq_lens, scale)
    too_long = torch.tensor([10, 33], dtype=torch.int32)  # 2 blocks of 16 hold 32
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_attention(query, cache.kv_cache, meta.block_tables, too_long, scale)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.paged_attention(query[..., :40], cache.kv_cache[..., :40].contiguous(), meta.block_tables,
                            meta.seq_lens, scale)


MIXED = [(5, 1), (31, 1), (16, 1), (0, 9), (16, 16), (7, 3), (20, 1), (0, 1), (40, 24)]  # (context, new) per seq


def run_mixed_batch(seqs: list[tuple[int, int]], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, dtype: torch.dtype, seed: int = 0,
                    window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """paged_attention on decodes and prefill chunks (with and without cached context). Returns (ours, float64)."""
    totals = [c + q for c, q in seqs]
    cache = PagedCache(totals, num_kv_heads, head_dim, block_size, dtype, seed)
    # The reference sees the final cache contents; the new tokens' K/V are those already in place.
    keys_values = [cache.keys_values(i, n) for i, n in enumerate(totals)]
    key = torch.cat([k[c:] for (k, _), (c, _) in zip(keys_values, seqs, strict=True)]).clone()
    value = torch.cat([v[c:] for (_, v), (c, _) in zip(keys_values, seqs, strict=True)]).clone()
    meta = AttentionMetadata.build([q for _, q in seqs], totals, cache.tables, block_size)
    gen = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(sum(q for _, q in seqs), num_heads, head_dim, generator=gen).to(dtype)
    scale = head_dim**-0.5
    reference = []
    for q, (k, v), (c, n) in zip(query.split([q for _, q in seqs]), keys_values, seqs, strict=True):
        reference.append(dense_reference(q, k, v, list(range(c + 1, c + n + 1)), scale, window))
    ours = paged_attention(query, key, value, cache.kv_cache, meta, scale, window)
    return ours, torch.cat(reference)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_mixed_batch(ops, fused: bool, dtype: torch.dtype) -> None:
    set_cpu_kernels_enabled(fused)
    ours, reference = run_mixed_batch(MIXED, 9, 3, 64, 16, dtype)
    assert ours.dtype == dtype
    torch.testing.assert_close(ours.double(), reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window_keeps_the_last_keys_only(ops, fused: bool, window: int) -> None:
    """Decodes and prefill chunks (from scratch and after a context longer than the window) see only
    keys at most window - 1 positions back; the C++ kernel walks from the window's start."""
    set_cpu_kernels_enabled(fused)
    ours, reference = run_mixed_batch(MIXED + [(0, 37), (50, 9)], 8, 2, 64, 16, torch.float32, seed=window,
                                      window=window)
    torch.testing.assert_close(ours.double(), reference, atol=1e-5, rtol=1e-5)


def test_paged_attention_paths_agree(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both switch positions on one batch; with the switch off the kernel is never called."""
    fused, _ = run_mixed_batch(MIXED, 8, 2, 128, 32, torch.float32, seed=11)
    set_cpu_kernels_enabled(False)
    monkeypatch.setattr(attention, "cpu_kernels", lambda: pytest.fail("kernel used while disabled"))
    native, _ = run_mixed_batch(MIXED, 8, 2, 128, 32, torch.float32, seed=11)
    torch.testing.assert_close(fused, native, atol=1e-5, rtol=1e-5)


def test_build_failure_falls_back_with_one_warning(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """No compiler or ninja: cpu_kernels() is None (one warning) and paged_attention uses torch."""
    from fleet.kernels import cpu_extension

    def no_compiler() -> None:
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.setattr(cpu_extension, "_ops", None)
    monkeypatch.setattr(cpu_extension, "_failed", False)
    monkeypatch.setattr(cpu_extension, "_load", no_compiler)
    with caplog.at_level("WARNING", logger=cpu_extension.__name__):
        assert cpu_extension.cpu_kernels() is None
        assert cpu_extension.cpu_kernels() is None
        ours, reference = run_mixed_batch(MIXED, 4, 2, 64, 16, torch.float32)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "Ninja" in caplog.records[0].getMessage()
    torch.testing.assert_close(ours.double(), reference, atol=1e-5, rtol=1e-5)
