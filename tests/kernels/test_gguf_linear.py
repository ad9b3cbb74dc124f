"""GGUF weights kept in their blocks (kernels/quantized.py,
csrc/gguf_linear_cpu.cpp) against gguf-py, the library transformers reads
GGUF files with: packing and looking rows up give its dequantized values bit
for bit, and the multiply gives its dequantized weights' products.

Tolerances: a float32 model multiplies the exact float32 weights, so only
the order of the float32 sums differs (rtol 1e-5), except where the CPU class
has AVX2 and a step has at most Q8_ROWS rows: there x is rounded to Q8 blocks
(per 32 values, d = max|x| / 127 and q = round(x / d)) and multiplied as
integers, as llama.cpp does, which the float32 tests bound. A bfloat16 model's
activations are bfloat16 and so is its output: up to 32 rows the kernel
multiplies the blocks' integers exactly and scales the sums, skipping the
rounding of each weight to bfloat16; above, it dequantizes into bfloat16
as loading did (with AVX2 but not AVX512-BF16, bfloat16 x takes the
float32 paths). Either way the result is within 2 % of the row's largest
output of the float32 product of the same bfloat16 activations."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from fleet.config.cpu_class import CpuClass, cpu_class, cpu_computes_bfloat16
from fleet.kernels.linear import AMX_BLOCK_ROWS, keep_amx_weights, linear
from fleet.kernels.quantized import GGUFWeight, quantized_linear

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "IQ4_NL"]
Q8_ROWS = 32
"""Most rows the AVX2 kernel rounds to Q8 (csrc/gguf_linear_cpu.cpp's Q8_ROWS)."""


def rounds_to_q8(rows: int) -> bool:
    """Whether a step of `rows` float32 rows takes the kernel's Q8 path here."""
    return cpu_class() >= CpuClass.avx2 and rows <= Q8_ROWS


def iq4_nl_blocks(weights: np.ndarray) -> np.ndarray:
    """float32 [rows, columns] -> IQ4_NL blocks [rows, bytes], which gguf-py
    cannot quantize into: per block d = (the value of largest |w|) / -127, as
    ggml starts from, and each weight's nearest table entry (no search for a
    better d: any valid blocks do for the tests)."""
    rows, columns = weights.shape
    table = np.array(gguf.quants.IQ4_NL.kvalues, dtype=np.float32)
    blocks = weights.reshape(rows, columns // 32, 32)
    largest = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=-1, keepdims=True), axis=-1)
    d = (largest / -127).astype(np.float16)
    q = np.abs(blocks[..., None] - d.astype(np.float32)[..., None] * table).argmin(axis=-1).astype(np.uint8)
    nibbles = q[..., :16] | q[..., 16:] << 4  # byte j: weight j low, j + 16 high
    return np.concatenate([d.view(np.uint8), nibbles], axis=-1).reshape(rows, -1)


def quantized(kind: str, rows: int, columns: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(the file's blocks [rows, bytes] of normal weights, gguf-py's float32 dequantization [rows, columns])"""
    weights = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    if kind == "IQ4_NL":
        blocks = iq4_nl_blocks(weights)
    else:
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
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 32, 33, 70])
@pytest.mark.parametrize("out_features,in_features", [(45, 64), (96, 576)])
def test_float32_multiply_is_the_dequantized_weights_product(ops, kind, rows, out_features, in_features):
    """Exact (rtol 1e-5) where the kernel multiplies float32 weights. Where it
    rounds x to Q8 first, each value moves by up to d / 2 = max|x| / 254 of
    its block: for random x and weights the outputs move by a few 1e-3 of the
    row's largest |output| (as llama.cpp's do), so 1.5 % of it bounds them
    and a wrong scale or offset, which moves them by far more, fails."""
    blocks, weight = quantized(kind, out_features, in_features)
    gguf_type = int(gguf.GGMLQuantizationType[kind])
    packed = ops.gguf_pack(blocks, gguf_type, in_features)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features)
    out = ops.gguf_linear(x, packed, gguf_type, out_features, bias)
    if not rounds_to_q8(rows):
        torch.testing.assert_close(out, x @ weight.T + bias, rtol=1e-5, atol=1e-4)
        return
    expected = x.double() @ weight.double().T + bias.double()
    error = (out.double() - expected).abs().max(dim=1).values
    assert (error <= 0.015 * expected.abs().max(dim=1).values).all(), error


def gguf_py_q8(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel's Q8 path rounds it: gguf-py's Q8_0 integers,
    times the block's max|x| / 127 in float32 (the file format would round
    that scale to float16; the kernel keeps it)."""
    rows, columns = x.shape
    blocks = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(rows, columns // 32, 34)
    q = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:])).view(torch.int8).double()
    scale = x.reshape(rows, columns // 32, 32).abs().amax(dim=-1, keepdim=True) / 127
    return (q * scale.double()).reshape(rows, columns)


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 4, 7, 13, Q8_ROWS])
def test_q8_path_is_the_product_of_q8_rounded_activations(ops, kind, rows):
    """The Q8 path gives the dequantized weights times x rounded to Q8 blocks
    by gguf-py, up to float32 sums: within 2e-5 of the row's largest |output|
    (they differ by ~3e-7). One value rounded the other way moves an output
    by ~2e-4 of it, so a wrong rounding, scale or offset fails. (gguf-py
    divides by d where the kernel multiplies by 127 / max|x|: the two could
    round a tie apart; these inputs have none. And the test cannot ask the
    Q8 path to be as close to the true product as bfloat16 activations:
    Q8 keeps 7 bits against its block's largest value, bfloat16 8 against
    each value's own, so its error is 2-3x bfloat16's.)"""
    if not rounds_to_q8(rows):
        pytest.skip(f"the {cpu_class().name} class multiplies float32 x exactly")
    blocks, weight = quantized(kind, 96, 1536)
    gguf_type = int(gguf.GGMLQuantizationType[kind])
    packed = ops.gguf_pack(blocks, gguf_type, 1536)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(3))
    x[0, :32] = 0  # a zero block: scale 0, no division by it
    out = ops.gguf_linear(x, packed, gguf_type, 96, None)
    expected = gguf_py_q8(x) @ weight.double().T
    error = (out.double() - expected).abs().max(dim=1).values
    assert (error <= 2e-5 * expected.abs().max(dim=1).values).all(), error
    true_error = (out.double() - x.double() @ weight.double().T).abs().max(dim=1).values
    assert (true_error <= 0.015 * expected.abs().max(dim=1).values).all(), true_error


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


class KeptLayer(torch.nn.Module):
    """A linear layer whose weight is kept blocks, with the slot for their AMX copy (parallel/layers.py)."""

    amx_weight = None

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.weight.gguf_type, self.weight.gguf_shape = weight.gguf_type, weight.gguf_shape


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not cpu_computes_bfloat16(),
                    reason="oneDNN prepacks bfloat16 only on a CPU class with native bfloat16")
@pytest.mark.parametrize("kind", TYPES)
def test_the_amx_copy_serves_steps_of_many_rows_and_the_blocks_the_rest(ops, kind):
    """keep_amx_weights gives a kept layer its blocks in bfloat16, prepacked: steps of more than
    AMX_BLOCK_ROWS rows multiply that (the rounded weights' product), fewer the blocks, as before."""
    out_features, in_features = 100, 576
    blocks, weight = quantized(kind, out_features, in_features)
    gguf_type = int(gguf.GGMLQuantizationType[kind])
    packed = ops.gguf_pack(blocks, gguf_type, in_features)
    packed.gguf_type, packed.gguf_shape = gguf_type, (out_features, in_features)
    layer = KeptLayer(packed)
    assert keep_amx_weights(torch.nn.Sequential(layer, torch.nn.Linear(4, 4))) == out_features * in_features * 2
    assert layer.amx_weight.is_mkldnn and layer.weight.dtype == torch.uint8  # the blocks stay
    bias = torch.randn(out_features).bfloat16()
    for rows in (AMX_BLOCK_ROWS + 1, 24, 300):  # 24: padded to 33 rows for oneDNN (ONEDNN_SLOW_ROWS)
        x = torch.randn(rows, 1, in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
        out = linear(x, layer.weight, bias, None, layer.amx_weight)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 1, out_features)
        expected = x.float() @ weight.bfloat16().float().T + bias.float()
        torch.testing.assert_close(out.float(), expected, rtol=2**-8, atol=1e-3)
    few = torch.randn(AMX_BLOCK_ROWS, in_features).bfloat16()
    assert torch.equal(linear(few, layer.weight, bias, None, layer.amx_weight), quantized_linear(few, packed, bias))
