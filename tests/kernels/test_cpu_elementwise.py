"""The fused C++ elementwise kernels (CPU: rms_norm, fused_add_rms_norm,
silu_and_mul) against the torch-native code they replace. Skipped where the
kernels cannot be built."""
from __future__ import annotations

import pytest
import torch

from fleet.kernels.activation import silu_and_mul
from fleet.kernels.attention import set_cpu_kernels_enabled
from fleet.kernels.rmsnorm import fused_add_rms_norm, rms_norm

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
DTYPES = list(TOLERANCE)
# Row lengths: a multiple of 32, of 16 only, and ragged (masked tails; 30: 16, then a whole 8 before the tail).
SHAPES = [(7, 576), (33, 80), (5, 100), (3, 30), (1, 3), (0, 64)]


def _torch(fn, *args):
    set_cpu_kernels_enabled(False)
    try:
        return fn(*args)
    finally:
        set_cpu_kernels_enabled(True)


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(ops, dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=0)
    w = _randn(shape[-1], dtype=dtype, seed=1)
    _close(ops.rms_norm(x, w, 1e-6), _torch(rms_norm, x, w, 1e-6), dtype)
    _close(rms_norm(x, w, 1e-6), _torch(rms_norm, x, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(ops, dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=2)
    res = _randn(*shape, dtype=dtype, seed=3)
    w = _randn(shape[-1], dtype=dtype, seed=4)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = fused_add_rms_norm(x, res, w, 1e-5)
    want_normed, want_res = _torch(fused_add_rms_norm, x, res, w, 1e-5)
    # The sum is rounded to the dtype exactly as torch does it.
    assert torch.equal(new_res, want_res)
    _close(normed, want_normed, dtype)
    # No input is modified, and the outputs are new tensors.
    assert torch.equal(x, x0) and torch.equal(res, res0)
    if x.numel():
        assert new_res.data_ptr() not in (x.data_ptr(), res.data_ptr())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 2 * 1536), (3, 2 * 40), (4, 2 * 13), (0, 32)])
def test_silu_and_mul(ops, dtype, shape):
    x = _randn(*shape, dtype=dtype, seed=5)
    _close(silu_and_mul(x), _torch(silu_and_mul, x), dtype)


def test_silu_extremes(ops):
    x = torch.tensor([[-100.0, -20.0, -1.0, 0.0, 1.0, 20.0, 100.0, 88.5] + [2.0] * 8], dtype=torch.float32)
    _close(silu_and_mul(x), _torch(silu_and_mul, x), torch.float32)


def test_non_contiguous_rows_and_3d(ops):
    base = _randn(6, 2, 64, dtype=torch.bfloat16, seed=6)
    x = base[:, 0]  # rows strided, last dim contiguous
    w = _randn(64, dtype=torch.bfloat16, seed=7)
    _close(rms_norm(x, w, 1e-6), _torch(rms_norm, x, w, 1e-6), torch.bfloat16)
    _close(rms_norm(base, w, 1e-6), _torch(rms_norm, base, w, 1e-6), torch.bfloat16)
    normed, new_res = fused_add_rms_norm(x, base[:, 1], w, 1e-6)
    want = _torch(fused_add_rms_norm, x, base[:, 1], w, 1e-6)
    _close(normed, want[0], torch.bfloat16)
    assert torch.equal(new_res, want[1])
    _close(silu_and_mul(base), _torch(silu_and_mul, base), torch.bfloat16)


def test_transposed_falls_back():
    x = _randn(64, 8, dtype=torch.float32, seed=8).t()  # last dim not contiguous: the torch path
    w = _randn(64, dtype=torch.float32, seed=9)
    _close(rms_norm(x, w, 1e-6), _torch(rms_norm, x, w, 1e-6), torch.float32)
