"""The Triton kernels (kernels/triton_ops.py) in Triton's interpreter on CPU
tensors, against the torch-native versions that CPU workers without the
fused kernels run: edge shapes (one token, block boundaries, ragged batches,
GQA ratios, head_dim not a power of two, empty expert groups), float32 and
bfloat16. With FLEET_TRITON_TEST_DEVICE=cuda (scripts/gpu_smoke.py) the same
cases run the compiled kernels on the GPU; the references stay on the CPU.

Tolerances: float32 1e-5 (the same math in another order; 1e-3 on a GPU,
whose tl.dot may use TF32); bfloat16 one or two units in the last place
(2e-2), since the interpreter rounds float32 to bfloat16 by truncation where
torch rounds to nearest.
"""
from __future__ import annotations

import os

DEVICE = os.environ.get("FLEET_TRITON_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton_ops decorates its kernels

import pytest  # noqa: E402
import torch  # noqa: E402

from fleet.kernels import triton_ops  # noqa: E402
from fleet.kernels.attention import AttentionMetadata, set_cpu_kernels_enabled, write_kv_cache  # noqa: E402
from fleet.kernels.rotary import apply_rotary, cos_sin_cache, inverse_frequencies, rope_parameters  # noqa: E402

TOLERANCE = {torch.float32: 1e-5 if DEVICE == "cpu" else 1e-3, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def torch_native_oracle():
    """The references below are the torch-native paths, not the C++ kernels."""
    set_cpu_kernels_enabled(False)
    yield
    set_cpu_kernels_enabled(True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float(), atol=tolerance, rtol=tolerance)


def on(*tensors: torch.Tensor):
    """The kernels' inputs on the device under test (the references keep the CPU copies)."""
    moved = tuple(t.to(DEVICE) for t in tensors)
    return moved if len(moved) > 1 else moved[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (3, 1000)])
def test_rms_norm_and_the_fused_residual_add(dtype, rows, hidden):
    from fleet.kernels.rmsnorm import fused_add_rms_norm, rms_norm

    generator = torch.Generator().manual_seed(rows * hidden)
    x, residual = (torch.randn(rows, hidden, generator=generator).to(dtype) for _ in range(2))
    weight = (torch.rand(hidden, generator=generator) + 0.5).to(dtype)
    assert_close(triton_ops.rms_norm(*on(x, weight), 1e-6), rms_norm(x, weight, 1e-6), dtype)
    normed, summed = triton_ops.fused_add_rms_norm(*on(x, residual, weight), 1e-6)
    expected_normed, expected_sum = fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_close(summed, expected_sum, dtype)
    assert_close(normed, expected_normed, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 8), (7, 2 * 300), (2, 3, 2 * 1500)])
def test_silu_and_mul(dtype, shape):
    from fleet.kernels.activation import silu_and_mul

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert_close(triton_ops.silu_and_mul(on(x)), silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,head_dim", [(1, 1, 8), (6, 4, 64), (3, 3, 80)])
def test_rotary_in_place(dtype, num_tokens, num_heads, head_dim):
    cache = cos_sin_cache(inverse_frequencies(head_dim, rope_parameters({"rope_theta": 10000.0})), 64)
    generator = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, num_heads, head_dim, generator=generator).to(dtype)
    positions = torch.randint(0, 64, (num_tokens,), generator=generator)
    expected, _ = apply_rotary(positions, x, x, cache.to(dtype))
    rotated = triton_ops.rotate_(*on(x.clone(), positions, cache.to(dtype)))
    assert_close(rotated, expected, dtype)


def paged_batch(query_lens: list[int], seq_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                dtype: torch.dtype, generator: torch.Generator):
    """A cache holding each sequence's context at shuffled blocks, and the batch's metadata."""
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for count in blocks_per_seq:
        tables.append(order[start:start + count])
        start += count
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator).to(dtype)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, torch.device("cpu"))
    return kv_cache, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size,window",
                         [(4, 4, 16, 16, 0), (6, 2, 80, 8, 0), (8, 1, 32, 5, 0), (6, 2, 80, 8, 6)])
def test_paged_attention_rows_match_torch(dtype, num_heads, num_kv_heads, head_dim, block_size, window):
    """Two decodes, a prefill from scratch, and a chunk after a cached prefix
    that ends mid-block: the ragged batch a step sends."""
    from fleet.kernels.attention import paged_attention

    generator = torch.Generator().manual_seed(num_heads * head_dim)
    query_lens, seq_lens = [1, 1, 7, 5], [1, 19, 7, 2 * block_size + 3]
    kv_cache, meta = paged_batch(query_lens, seq_lens, num_kv_heads, head_dim, block_size, dtype, generator)
    num_rows = sum(query_lens)
    query = torch.randn(num_rows, num_heads, head_dim, generator=generator).to(dtype)
    key, value = (torch.randn(num_rows, num_kv_heads, head_dim, generator=generator).to(dtype) for _ in range(2))
    scale = head_dim ** -0.5
    expected = paged_attention(query, key, value, kv_cache.clone(), meta, scale, window)
    reference_cache = kv_cache.clone()
    write_kv_cache(key, value, reference_cache, meta.slot_mapping)
    triton_cache = on(kv_cache.clone())  # a copy on the CPU too: the write must be the kernel's own
    triton_ops.write_kv_cache(*on(key, value), triton_cache, on(meta.slot_mapping))
    assert torch.equal(triton_cache.cpu(), reference_cache), "the new keys and values land in their slots"
    seq_index, kv_lens = meta._token_rows
    actual = triton_ops.paged_attention(on(query), triton_cache, *on(meta.block_tables, seq_index, kv_lens), scale,
                                        window)
    assert_close(actual, expected, dtype)


def test_a_row_with_no_keys_gets_zeros():
    generator = torch.Generator().manual_seed(0)
    kv_cache, meta = paged_batch([1], [4], 1, 16, 4, torch.float32, generator)
    query = torch.randn(1, 2, 16, generator=generator)
    out = triton_ops.paged_attention(*on(query, kv_cache, meta.block_tables, torch.tensor([0]), torch.tensor([0])),
                                     0.25)
    assert torch.equal(out.cpu(), torch.zeros_like(query))


def test_the_kernels_serve_cuda_tensors_only():
    assert not triton_ops.serves(torch.zeros(1))
    assert triton_ops.serves(torch.zeros(1, device=DEVICE)) == (DEVICE == "cuda")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,expert_offset", [(1, 0), (5, 0), (20, 2)])
def test_fused_moe_matches_the_torch_experts(dtype, num_tokens, expert_offset):
    """8 experts, this rank holding 4 of them from expert_offset (expert
    parallel: pairs routed elsewhere add nothing here); with 1 token most
    local experts get no pairs, and 20 pairs of one expert fill more than one block."""
    from fleet.kernels.moe import fused_moe, select_experts

    generator = torch.Generator().manual_seed(num_tokens)
    hidden_size, intermediate, num_experts, num_local, top_k = 40, 24, 8, 4, 2
    hidden = torch.randn(num_tokens, hidden_size, generator=generator).to(dtype)
    w13 = (torch.randn(num_local, 2 * intermediate, hidden_size, generator=generator) / 6).to(dtype)
    w2 = (torch.randn(num_local, hidden_size, intermediate, generator=generator) / 5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=generator)
    if num_tokens == 20:
        logits[:, expert_offset] += 10  # one expert takes every token: its pairs span two blocks
    weights, ids = select_experts(logits, top_k, renormalize=True)
    expected = fused_moe(hidden, w13, w2, weights, ids, expert_offset)
    actual = triton_ops.fused_moe(*on(hidden, w13, w2, weights, ids), expert_offset)
    assert_close(actual, expected, dtype)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows,out_features", [(1, 45), (17, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_linear_multiplies_the_blocks(kind, rows, out_features, dtype):
    """A GGUF file's rows of blocks (what a CUDA worker keeps), against
    gguf-py's dequantization multiplied in float32. bfloat16 rounds each
    weight to bfloat16 first, as loading dequantized weights did: within 2 %
    of each row's largest output."""
    import gguf
    import numpy as np

    in_features = 96
    gguf_type = gguf.GGMLQuantizationType[kind]
    weights = np.random.default_rng(3).standard_normal((out_features, in_features)).astype(np.float32)
    blocks = torch.from_numpy(gguf.quants.quantize(weights, gguf_type))
    dequantized = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf_type).copy())
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(4)).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    out = triton_ops.gguf_linear(*on(x, blocks), int(gguf_type), on(bias)).cpu()
    expected = x.float() @ dequantized.T + bias.float()
    if dtype == torch.float32:
        assert_close(out, expected, dtype)
    else:
        error = (out.float() - expected).abs().max(dim=1).values
        assert (error <= 0.02 * expected.abs().max(dim=1).values).all(), error
