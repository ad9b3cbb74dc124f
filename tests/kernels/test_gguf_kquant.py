"""K-quant weights (Q4_K, Q5_K, Q6_K) kept in the file's super-blocks
(kernels/quantized.py, csrc/gguf_kquant_cpu.cpp) against gguf-py, the
library transformers reads GGUF files with: looking rows up gives its
dequantized values bit for bit, the multiply its dequantized weights'
products.

gguf-py cannot quantize into K-quants, so the blocks are random bytes (every
byte pattern of the quants and packed scales is valid) with small positive
float16 d and dmin; gguf-py's `dequantize` is the reference.

Tolerances: a float32 model multiplies the exact float32 weights, so only
the order of the float32 sums differs (rtol 1e-5, atol 1e-4 for sums that
cancel). A bfloat16 model multiplies the weights rounded to bfloat16, as
loading dequantized weights did, in float32, and rounds the output to
bfloat16: within 2^-8 of the float32 product of the same bfloat16 values
(one rounding), plus 1e-3 absolute for outputs near zero."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.kernels.linear import AMX_BLOCK_ROWS, keep_amx_weights, linear
from fleet.kernels.quantized import KEPT_TYPES, GGUFWeight, quantized_linear

TYPES = ["Q4_K", "Q5_K", "Q6_K"]
SCALE_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
"""Where each type's float16 d (and dmin) sit in its super-block."""


def quantized(kind: str, rows: int, columns: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(random valid blocks [rows, bytes], gguf-py's float32 dequantization
    [rows, columns]); d and dmin are drawn so that the weights are of order 1."""
    rng = np.random.default_rng(seed)
    gguf_type = gguf.GGMLQuantizationType[kind]
    nbytes = KEPT_TYPES[int(gguf_type)].nbytes
    blocks = rng.integers(0, 256, (rows, columns // 256, nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scale = rng.uniform(2e-4, 1e-3, (rows, columns // 256, 1)).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8)
    blocks = blocks.reshape(rows, -1)
    dequantized = gguf.quants.dequantize(blocks, gguf_type)
    return torch.from_numpy(blocks), torch.from_numpy(np.ascontiguousarray(dequantized))


def type_of(kind: str) -> int:
    return int(gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows,columns", [(1, 256), (45, 512), (96, 768)])
def test_rows_are_gguf_py_dequantization(ops, kind, rows, columns):
    blocks, expected = quantized(kind, rows, columns)
    ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    assert torch.equal(ops.gguf_kquant_rows(blocks, type_of(kind), columns, ids, torch.float32), expected[ids])
    assert torch.equal(ops.gguf_kquant_rows(blocks, type_of(kind), columns, ids, torch.bfloat16),
                       expected[ids].bfloat16())
    weight = GGUFWeight(type_of(kind), blocks, (rows, columns))
    assert weight.is_kept and torch.equal(weight.dequantize(torch.float32), expected)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 33])
@pytest.mark.parametrize("out_features,in_features", [(45, 256), (96, 768)])
def test_float32_multiply_is_the_dequantized_weights_product(ops, kind, rows, out_features, in_features):
    blocks, weight = quantized(kind, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
    out = ops.gguf_kquant_linear(x, blocks, type_of(kind), out_features, bias)
    torch.testing.assert_close(out, x @ weight.T + bias, rtol=1e-5, atol=1e-4)
    unbiased = ops.gguf_kquant_linear(x, blocks, type_of(kind), out_features, None)
    torch.testing.assert_close(unbiased, x @ weight.T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_bfloat16_multiply_is_the_rounded_weights_product(ops, kind, rows):
    out_features, in_features = 45, 512
    blocks, weight = quantized(kind, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = ops.gguf_kquant_linear(x, blocks, type_of(kind), out_features, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    expected = x.float() @ weight.bfloat16().float().T + bias.float()
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)


def test_bad_inputs_are_refused(ops):
    blocks, _ = quantized("Q4_K", 32, 512)
    q4_k = type_of("Q4_K")
    with pytest.raises(RuntimeError, match="no K-quant CPU kernel"):
        ops.gguf_kquant_linear(torch.randn(2, 512), blocks, type_of("Q4_0"), 32, None)
    with pytest.raises(RuntimeError, match="do not hold"):
        ops.gguf_kquant_linear(torch.randn(2, 512), blocks, type_of("Q6_K"), 32, None)
    with pytest.raises(RuntimeError, match="do not hold 768 input features"):
        ops.gguf_kquant_linear(torch.randn(2, 768), blocks, q4_k, 32, None)
    with pytest.raises(RuntimeError, match="not 33 output features"):
        ops.gguf_kquant_linear(torch.randn(2, 512), blocks, q4_k, 33, None)
    with pytest.raises(RuntimeError, match="x: contiguous"):
        ops.gguf_kquant_linear(torch.randn(512, 2).T, blocks, q4_k, 32, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.gguf_kquant_linear(torch.randn(2, 512), blocks, q4_k, 32, torch.randn(32).bfloat16())
    with pytest.raises(RuntimeError, match="uint8"):
        ops.gguf_kquant_rows(blocks.view(torch.int8), q4_k, 512, torch.tensor([0]), torch.float32)
    with pytest.raises(RuntimeError, match="outside the table"):
        ops.gguf_kquant_rows(blocks, q4_k, 512, torch.tensor([32]), torch.float32)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        ops.gguf_kquant_rows(blocks, q4_k, 512, torch.tensor([0]), torch.int32)


@pytest.mark.parametrize("kind", TYPES)
def test_slices_cut_whole_super_blocks_or_dequantize(kind):
    """What the tensor-parallel loaders read: rows, and columns on
    super-block boundaries, stay blocks; columns across one are dequantized,
    even on a 32-weight boundary."""
    blocks, weight = quantized(kind, 8, 1024)
    full = GGUFWeight(type_of(kind), blocks, (8, 1024))
    rows = full[2:5]
    assert isinstance(rows, GGUFWeight) and rows.shape == (3, 1024)
    assert torch.equal(rows.dequantize(torch.float32), weight[2:5])
    columns = full[:, 512:768]
    assert isinstance(columns, GGUFWeight) and columns.shape == (8, 256)
    assert torch.equal(columns.dequantize(torch.float32), weight[:, 512:768])
    across = full[:, 384:640]
    assert isinstance(across, torch.Tensor) and torch.equal(across, weight[:, 384:640])
    assert not GGUFWeight(type_of(kind), blocks[:, :0], (8, 128)).is_kept  # not whole super-blocks


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not cpu_computes_bfloat16(),
                    reason="oneDNN prepacks bfloat16 only on a CPU class with native bfloat16")
@pytest.mark.parametrize("kind", TYPES)
def test_the_amx_copy_of_super_blocks_is_the_rounded_weights(ops, kind):
    """keep_amx_weights dequantizes a layer's super-blocks to bfloat16 for oneDNN: steps of more
    than AMX_BLOCK_ROWS rows get the rounded weights' product."""
    rows, out_features, in_features = AMX_BLOCK_ROWS + 7, 45, 512
    blocks, weight = quantized(kind, out_features, in_features)
    blocks.gguf_type, blocks.gguf_shape = type_of(kind), (out_features, in_features)
    layer = torch.nn.Module()
    layer.weight, layer.amx_weight = torch.nn.Parameter(blocks, requires_grad=False), None
    layer.weight.gguf_type, layer.weight.gguf_shape = blocks.gguf_type, blocks.gguf_shape
    assert keep_amx_weights(layer) == out_features * in_features * 2
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(6)).bfloat16()
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(7)).bfloat16()
    out = linear(x, layer.weight, bias, None, layer.amx_weight)
    expected = x.float() @ weight.bfloat16().float().T + bias.float()
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)
