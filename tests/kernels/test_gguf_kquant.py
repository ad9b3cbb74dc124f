"""K-quant weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS) kept in the file's super-blocks
(kernels/quantized.py, csrc/gguf_kquant_cpu.cpp) against gguf-py, the
library transformers reads GGUF files with: looking rows up gives its
dequantized values bit for bit, the multiply its dequantized weights'
products.

gguf-py cannot quantize into K-quants, so the blocks are random bytes (every
byte pattern of the quants and packed scales is valid) with small positive
float16 d and dmin; gguf-py's `dequantize` is the reference.
kernels/quantized.py chooses the path; each path is also called by name.

The multiply has two paths. The float32 tiles (steps of more than
INTEGER_ROWS rows, and every step on class baseline) multiply the exact
float32 weights, so only the order of the float32 sums differs (rtol 1e-5,
atol 1e-4 for sums that cancel; for larger x, 1e-5 of sum_k |w_k x_k|). The integer path (up to INTEGER_ROWS rows
on class avx2 and up) first rounds each row of x to Q8_K: per 256 values
d = max|x| / 127 and q = round(x / d), so each value moves by at most d / 2
= max|x| / 254 of its super-block. Its integer sums are exact, so it gives
the dequantized weights times the rounded x up to float32 rounding
(within 1e-5 of sum_k |w_k| |d q_k|, the size of the sum's terms); against
the unrounded x that adds at most sum_k |w_k| max|x|_b(k) / 254, the bound
the tests hold it to (real errors, which cancel, are far smaller).

A bfloat16 model multiplies the weights rounded to bfloat16 on the float32
path, as loading dequantized weights did, and the exact weights times the
rounded x on the integer path, and rounds the output to bfloat16: within
2^-8 of the float32 product of the same values (one rounding), plus 1e-3
absolute for outputs near zero."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from fleet.config.cpu_class import CpuClass, cpu_class, cpu_computes_bfloat16
from fleet.kernels.linear import AMX_BLOCK_ROWS, keep_amx_weights, linear
from fleet.kernels.quantized import KEPT_TYPES, GGUFWeight, kquant_integer_compiled, quantized_linear
from fleet.kernels.quantized import KQUANT_INTEGER_ROWS as INTEGER_ROWS

TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"]
SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
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


def kept(blocks: torch.Tensor, kind: str, out_features: int, in_features: int) -> torch.Tensor:
    """`blocks` as keep_quantized leaves a kept weight: tagged with its type and shape."""
    blocks.gguf_type, blocks.gguf_shape = type_of(kind), (out_features, in_features)
    return blocks


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


def has_integer_path() -> bool:
    return cpu_class() >= CpuClass.avx2


def takes_integer_path(rows: int) -> bool:
    """Whether quantized_linear rounds a float32 step of `rows` rows to Q8_K here."""
    return has_integer_path() and rows <= INTEGER_ROWS


def test_the_build_has_the_integer_path_from_class_avx2(ops):
    assert kquant_integer_compiled() == ops.gguf_kquant_integer_compiled() == has_integer_path()


def q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] rounded to Q8_K as the kernel rounds it, in float64: d q; each
    value's bound on its move, max|x| / 254 of its super-block)."""
    blocks = x.float().reshape(x.shape[0], -1, 256)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0.0))  # float32, ties to even, as the kernel
    rounded = q.double() * (amax / 127).double()
    return rounded.reshape(x.shape), (amax.double() / 254).expand_as(blocks).reshape(x.shape)


def assert_integer_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           rtol: float = 1e-5) -> None:
    """`out` is the integer path's x W^T + bias: the rounded x's product within
    rtol of its terms' size, and the unrounded x's within the rounding's bound."""
    rounded, move = q8_k(x)
    w = weight.double()
    offset = 0 if bias is None else bias.double()
    expected = rounded @ w.T + offset
    terms = rounded.abs() @ w.abs().T
    error = (out.double() - expected).abs()
    assert (error <= rtol * terms + 1e-6).all(), (error / terms).max()
    bound = move @ w.abs().T * (1 + 1e-5)
    assert ((out.double() - (x.double() @ w.T + offset)).abs() <= bound + rtol * terms + 1e-6).all()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 32, 33])
@pytest.mark.parametrize("out_features,in_features", [(45, 256), (96, 768)])
def test_float32_multiply_is_the_dequantized_weights_product(ops, kind, rows, out_features, in_features):
    blocks, weight = quantized(kind, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
    for b in (bias, None):
        out = quantized_linear(x, kept(blocks, kind, out_features, in_features), b)
        if takes_integer_path(rows):
            assert_integer_product(out, x, weight, b)
        else:
            torch.testing.assert_close(out, x @ weight.T + (0 if b is None else b), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(not has_integer_path(), reason="the integer path needs CPU class avx2")
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 32, 40])
@pytest.mark.parametrize("out_features,in_features", [(1, 256), (45, 256), (97, 1280)])
def test_integer_path_is_the_rounded_x_product(ops, kind, rows, out_features, in_features):
    """Each path by name, on both sides of INTEGER_ROWS: one super-block or
    five per row, features not a multiple of any tile or task."""
    blocks, weight = quantized(kind, out_features, in_features, seed=rows)
    x = 3 * torch.randn(rows, in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(5))
    out = ops.gguf_kquant_linear_by(x, blocks, type_of(kind), out_features, bias, True)
    assert_integer_product(out, x, weight, bias)
    exact = ops.gguf_kquant_linear_by(x, blocks, type_of(kind), out_features, bias, False)
    expected = x.double() @ weight.double().T + bias.double()
    assert ((exact.double() - expected).abs() <= 1e-5 * (x.double().abs() @ weight.double().abs().T) + 1e-6).all()
    chosen = quantized_linear(x, kept(blocks, kind, out_features, in_features), bias)
    assert torch.equal(chosen, out if rows <= INTEGER_ROWS else exact)


@pytest.mark.skipif(not has_integer_path(), reason="the integer path needs CPU class avx2")
def test_integer_path_rounds_each_super_block_alone(ops):
    """A super-block of x holding NaN makes every output NaN; one of zeros
    adds nothing, and large values in one do not coarsen the others."""
    blocks, weight = quantized("Q4_K", 20, 768)
    x = torch.randn(3, 768, generator=torch.Generator().manual_seed(8))
    x[0, 300] = float("nan")
    x[1, :256] = 0
    x[2, 512:] *= 1e4
    out = ops.gguf_kquant_linear_by(x, blocks, type_of("Q4_K"), 20, None, True)
    assert out[0].isnan().all() and not out[1:].isnan().any()
    assert_integer_product(out[1:], x[1:], weight, None)


def test_integer_path_is_refused_without_avx2(ops):
    if has_integer_path():
        pytest.skip("this CPU class has the integer path")
    blocks, _ = quantized("Q6_K", 4, 256)
    with pytest.raises(RuntimeError, match="needs AVX2"):
        ops.gguf_kquant_linear_by(torch.randn(1, 256), blocks, type_of("Q6_K"), 4, None, True)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_bfloat16_multiply_is_the_rounded_weights_product(ops, kind, rows):
    out_features, in_features = 45, 512
    blocks, weight = quantized(kind, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = ops.gguf_kquant_linear_by(x, blocks, type_of(kind), out_features, bias, takes_integer_path(rows))
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    if takes_integer_path(rows):
        expected = q8_k(x)[0].float() @ weight.T + bias.float()
    else:
        expected = x.float() @ weight.bfloat16().float().T + bias.float()
    torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("kind", TYPES)
def test_bfloat16_prefill_is_the_dequantized_models_linear(ops, kind):
    """A step of more rows than the integer path takes, in a bfloat16 model:
    on a CPU with native bfloat16 the weight is dequantized for the call and
    multiplied by oneDNN, which gives what F.linear of the dequantized model
    gives, bit for bit; elsewhere the float32 tiles (the bound above)."""
    out_features, in_features, rows = 45, 512, INTEGER_ROWS + 7
    blocks, weight = quantized(kind, out_features, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(5)).bfloat16()
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(6)).bfloat16()
    out = quantized_linear(x, kept(blocks, kind, out_features, in_features), bias)
    dequantized_model = torch.nn.functional.linear(x, weight.bfloat16(), bias)
    if cpu_computes_bfloat16():
        assert torch.equal(out, dequantized_model)
    else:
        torch.testing.assert_close(out.float(), dequantized_model.float(), rtol=2**-7, atol=2e-3)


@pytest.mark.skipif(not cpu_computes_bfloat16(), reason="the dequantizing path needs native bfloat16")
def test_bfloat16_prefill_dequantized_in_runs_of_rows_is_the_same_linear(ops, monkeypatch):
    """A weight larger than the dequantization buffer is multiplied a run of
    its rows at a time (here runs of 10 of 45 rows, the last of 5): the
    same products, bias included, as F.linear of the whole dequantized weight."""
    import fleet.kernels.quantized as quantized_module

    out_features, in_features = 45, 512
    monkeypatch.setattr(quantized_module, "_scratch", torch.empty(10 * in_features, dtype=torch.bfloat16))
    blocks, weight = quantized("Q4_K", out_features, in_features)
    x = torch.randn(INTEGER_ROWS + 7, in_features, generator=torch.Generator().manual_seed(7)).bfloat16()
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(8)).bfloat16()
    out = quantized_linear(x, kept(blocks, "Q4_K", out_features, in_features), bias)
    assert torch.equal(out, torch.nn.functional.linear(x, weight.bfloat16(), bias))


def test_dequantize_into_refuses_rows_outside_the_weight(ops):
    blocks, _ = quantized("Q4_K", 32, 512)
    with pytest.raises(RuntimeError, match="outside the weight"):
        ops.gguf_kquant_dequantize_into(blocks, type_of("Q4_K"), 30, torch.empty(4, 512, dtype=torch.bfloat16))


def test_bad_inputs_are_refused(ops):
    blocks, _ = quantized("Q4_K", 32, 512)
    q4_k = type_of("Q4_K")

    def linear_by(*args):  # the float32 tiles: both paths check their inputs alike
        return ops.gguf_kquant_linear_by(*args, False)

    with pytest.raises(RuntimeError, match="no K-quant CPU kernel"):
        linear_by(torch.randn(2, 512), blocks, type_of("Q4_0"), 32, None)
    with pytest.raises(RuntimeError, match="do not hold"):
        linear_by(torch.randn(2, 512), blocks, type_of("Q6_K"), 32, None)
    with pytest.raises(RuntimeError, match="do not hold 768 input features"):
        linear_by(torch.randn(2, 768), blocks, q4_k, 32, None)
    with pytest.raises(RuntimeError, match="not 33 output features"):
        linear_by(torch.randn(2, 512), blocks, q4_k, 33, None)
    with pytest.raises(RuntimeError, match="x: contiguous"):
        linear_by(torch.randn(512, 2).T, blocks, q4_k, 32, None)
    with pytest.raises(RuntimeError, match="bias"):
        linear_by(torch.randn(2, 512), blocks, q4_k, 32, torch.randn(32).bfloat16())
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
