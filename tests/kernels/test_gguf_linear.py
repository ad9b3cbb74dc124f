"""GGUF weights kept in their blocks (kernels/quantized.py,
csrc/gguf_linear_cpu.cpp) against gguf-py, the library transformers reads
GGUF files with: packing and looking rows up give its dequantized values bit
for bit, and the multiply gives its dequantized weights' products.

Tolerances: a float32 model multiplies the exact float32 weights, so only
the order of the float32 sums differs (rtol 1e-5). A bfloat16 model's
activations are bfloat16 and so is its output: up to 32 rows the kernel
multiplies the blocks' integers exactly and scales the sums, skipping the
rounding of each weight to bfloat16; above, it dequantizes into bfloat16
as loading did. Either way the result is within 2 % of the row's largest
output of the float32 product of the same bfloat16 activations."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from fleet.kernels.quantized import GGUFWeight

TYPES = ["Q4_0", "Q4_1", "Q8_0"]


def quantized(kind: str, rows: int, columns: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's blocks [rows, bytes], gguf-py's float32 dequantization [rows, columns])"""
    weights = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[kind])
    dequantized = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[kind])
    return torch.from_numpy(blocks), torch.from_numpy(np.ascontiguousarray(dequantized))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows,columns", [(1, 32), (45, 64), (96, 576)])
def test_rows_of_packed_blocks_are_gguf_py_dequantization(ops, kind, rows, columns):
    blocks, expected = quantized(kind, rows, columns)
    gguf_type = int(gguf.GGMLQuantizationType[kind])
    packed = ops.gguf_pack(blocks, gguf_type, columns)
    assert packed.nbytes <= blocks.nbytes * 32 * -(-rows // 32) / rows  # the file's bytes, panels padded
    ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    assert torch.equal(ops.gguf_rows(packed, gguf_type, columns, ids, torch.float32), expected[ids])
    assert torch.equal(ops.gguf_rows(packed, gguf_type, columns, ids, torch.bfloat16), expected[ids].bfloat16())
    weight = GGUFWeight(gguf_type, blocks, (rows, columns))
    assert torch.equal(weight.dequantize(torch.float32), expected)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("out_features,in_features", [(45, 64), (96, 576)])
def test_float32_multiply_is_the_dequantized_weights_product(ops, kind, rows, out_features, in_features):
    blocks, weight = quantized(kind, out_features, in_features)
    gguf_type = int(gguf.GGMLQuantizationType[kind])
    packed = ops.gguf_pack(blocks, gguf_type, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features)
    out = ops.gguf_linear(x, packed, gguf_type, out_features, bias)
    torch.testing.assert_close(out, x @ weight.T + bias, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 32, 33, 70])  # straight from the blocks up to 32, dequantized above
@pytest.mark.parametrize("out_features,in_features", [(45, 64), (100, 1536)])
def test_bfloat16_multiply_is_near_the_float32_product(ops, kind, rows, out_features, in_features):
    blocks, weight = quantized(kind, out_features, in_features)
    gguf_type = int(gguf.GGMLQuantizationType[kind])
    packed = ops.gguf_pack(blocks, gguf_type, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(2)).bfloat16()
    bias = torch.randn(out_features).bfloat16()
    out = ops.gguf_linear(x, packed, gguf_type, out_features, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    expected = x.float() @ weight.T + bias.float()
    error = (out.float() - expected).abs().max(dim=1).values
    assert (error <= 0.02 * expected.abs().max(dim=1).values).all(), error


def test_bad_weights_are_refused(ops):
    blocks, _ = quantized("Q4_1", 32, 64)
    with pytest.raises(RuntimeError, match="no CPU kernel"):
        ops.gguf_pack(blocks, int(gguf.GGMLQuantizationType.Q6_K), 64)
    with pytest.raises(RuntimeError, match="do not hold"):
        ops.gguf_pack(blocks, int(gguf.GGMLQuantizationType.Q4_1), 96)
    packed = ops.gguf_pack(blocks, int(gguf.GGMLQuantizationType.Q4_1), 64)
    with pytest.raises(RuntimeError, match="input features"):
        ops.gguf_linear(torch.randn(2, 96), packed, int(gguf.GGMLQuantizationType.Q4_1), 32, None)
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.gguf_rows(packed, int(gguf.GGMLQuantizationType.Q4_1), 64, torch.tensor([32]), torch.float32)


def test_slices_cut_whole_blocks_or_dequantize(ops):
    """What the tensor-parallel loaders read: rows, and columns on block
    boundaries, stay blocks; columns across a block are dequantized."""
    blocks, weight = quantized("Q4_1", 8, 128)
    full = GGUFWeight(int(gguf.GGMLQuantizationType.Q4_1), blocks, (8, 128))
    rows = full[2:5]
    assert isinstance(rows, GGUFWeight) and rows.shape == (3, 128)
    assert torch.equal(rows.dequantize(torch.float32), weight[2:5])
    columns = full[:, 64:128]
    assert isinstance(columns, GGUFWeight) and columns.shape == (8, 64)
    assert torch.equal(columns.dequantize(torch.float32), weight[:, 64:128])
    across = full[:, 48:80]
    assert isinstance(across, torch.Tensor) and torch.equal(across, weight[:, 48:80])
