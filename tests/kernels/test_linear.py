"""The bfloat16 copy of linear weights that decode steps use on a CPU
(kernels/linear.py, csrc/linear_bf16_weight_cpu.cpp), against torch's matmul
of the same weights: float32 for a float32 model (the widened weights),
bfloat16 for a bfloat16 one."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.kernels.linear import (
    decode_rows,
    PANEL,
    keep_bfloat16_decode_weights,
    linear,
    pack_bfloat16,
    prepack_prefill_weights,
)


def bf16_exact(*shape: int, seed: int) -> torch.Tensor:
    """float32 values that bfloat16 holds exactly (a bfloat16 checkpoint's)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16().float()


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 17, 32])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (7, 16), (130, 37), (96, 576), (5, 1), (48, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float32_matmul(ops, rows, out_features, in_features, with_bias):
    weight = bf16_exact(out_features, in_features, seed=0)
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1))
    bias = torch.randn(out_features) if with_bias else None
    got = ops.linear_bf16_weight(x, pack_bfloat16(weight), out_features, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5 * in_features**0.5)


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
@pytest.mark.parametrize("out_features,in_features", [(64, 64), (130, 37), (96, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_activations_match_bfloat16_matmul(ops, rows, out_features, in_features, with_bias):
    """Both sum float32 products of the same bfloat16 numbers and round once
    to bfloat16, in different orders: a rounding step apart at most."""
    weight = bf16_exact(out_features, in_features, seed=0).bfloat16()
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()
    bias = torch.randn(out_features).bfloat16() if with_bias else None
    got = ops.linear_bf16_weight(x, pack_bfloat16(weight), out_features, bias)
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    for result in (got, F.linear(x, weight, bias)):
        torch.testing.assert_close(result.float(), exact, rtol=2**-8, atol=1e-5 * in_features**0.5)


def test_packing_puts_panels_k_major_and_pads_with_zeros():
    weight = torch.arange(40 * 3, dtype=torch.float32).view(40, 3)
    packed = pack_bfloat16(weight)
    assert packed.shape == (2, 3, PANEL) and packed.dtype == torch.bfloat16
    assert packed[1, 2, 7].item() == weight[PANEL + 7, 2].item()
    assert packed[1, :, 8:].eq(0).all()


def test_kernel_rejects_what_it_does_not_compute(ops):
    x, packed = torch.randn(2, 16), pack_bfloat16(torch.randn(40, 16))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.linear_bf16_weight(x.half(), packed, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.linear_bf16_weight(x.bfloat16(), packed, 40, torch.zeros(40))
    with pytest.raises(RuntimeError, match="features"):
        ops.linear_bf16_weight(torch.randn(2, 15), packed, 40, None)
    with pytest.raises(RuntimeError, match="panels"):
        ops.linear_bf16_weight(x, packed, 80, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_uses_the_copy_for_few_rows_only(ops, dtype):
    weight = bf16_exact(48, 32, seed=2).to(dtype)
    copy = pack_bfloat16(weight)
    few, many = torch.randn(decode_rows(), 32, dtype=dtype), torch.randn(decode_rows() + 1, 32, dtype=dtype)
    expected = ops.linear_bf16_weight(few, copy, 48, None)
    torch.testing.assert_close(linear(few, weight, None, copy), expected, rtol=0, atol=0)
    torch.testing.assert_close(linear(many, weight, None, copy), F.linear(many, weight), rtol=0, atol=0)
    torch.testing.assert_close(linear(few, weight), F.linear(few, weight), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_go_to_the_layers_that_take_them(dtype):
    class Layer(torch.nn.Module):
        decode_weight = None

        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(bf16_exact(8, 4, seed=3).to(dtype), requires_grad=False)

    model = torch.nn.Sequential(Layer(), torch.nn.Embedding(10, 4), Layer())
    added = keep_bfloat16_decode_weights(model)
    assert added == 2 * PANEL * 4 * 2  # two layers, each padded to one panel
    assert torch.equal(model[0].decode_weight.transpose(1, 2).reshape(PANEL, 4)[:8], model[0].weight.bfloat16())
    assert not hasattr(model[1], "decode_weight")
    model[0].decode_weight = None
    model[0].half()
    assert keep_bfloat16_decode_weights(model) == PANEL * 4 * 2  # the other layer only
    assert model[0].decode_weight is None  # float16: the kernel does not take it


class Layer(torch.nn.Module):
    decode_weight = None

    def __init__(self, weight: torch.nn.Parameter) -> None:
        super().__init__()
        self.weight = weight


def model_with_a_tied_layer() -> torch.nn.Sequential:
    """A bfloat16 layer of its own, an embedding, and a layer sharing the embedding's weight."""
    own = torch.nn.Parameter(bf16_exact(48, 32, seed=4).bfloat16(), requires_grad=False)
    embedding = torch.nn.Embedding(48, 32).bfloat16()
    return torch.nn.Sequential(Layer(own), embedding, Layer(embedding.weight))


@pytest.mark.skipif(not torch.backends.mkldnn.is_available() or not cpu_computes_bfloat16(),
                    reason="oneDNN prepacks bfloat16 only on a CPU class with native bfloat16")
def test_prepacked_weights_serve_steps_of_many_rows_and_shared_weights_stay_plain(ops):
    model = model_with_a_tied_layer()
    plain = model[0].weight.detach().clone()
    keep_bfloat16_decode_weights(model)
    assert prepack_prefill_weights(model) == 1
    assert model[0].weight.is_mkldnn and model[0].weight.shape == plain.shape
    assert not model[2].weight.is_mkldnn  # the embedding's: F.embedding needs it plain
    bias = torch.randn(48).bfloat16()
    for rows in (decode_rows() + 1, 24, 300):  # 24: padded to 33 rows for oneDNN (ONEDNN_SLOW_ROWS)
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        got = linear(x, model[0].weight, bias, model[0].decode_weight)
        torch.testing.assert_close(got, F.linear(x, plain, bias), rtol=2**-8, atol=1e-3)
    few = torch.randn(3, 32, dtype=torch.bfloat16)  # the decode copy, whatever the weight's layout
    torch.testing.assert_close(linear(few, model[0].weight, None, model[0].decode_weight),
                               ops.linear_bf16_weight(few, model[0].decode_weight, 48, None), rtol=0, atol=0)


@pytest.mark.skipif(cpu_computes_bfloat16(), reason="this CPU class prepacks (the test above)")
def test_below_native_bfloat16_weights_stay_plain_and_serve(ops):
    """On AVX2 (or FLEET_CPU_ISA=avx2/avx512) torch's reorder refuses or
    emulates bfloat16: nothing is prepacked and F.linear serves many rows."""
    model = model_with_a_tied_layer()
    plain = model[0].weight.detach().clone()
    keep_bfloat16_decode_weights(model)
    assert prepack_prefill_weights(model) == 0
    assert not any(layer.weight.is_mkldnn for layer in model)
    x = torch.randn(decode_rows() + 1, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(linear(x, model[0].weight, None, model[0].decode_weight), F.linear(x, plain),
                               rtol=0, atol=0)
