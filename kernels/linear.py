"""The matmul of every linear layer, and the bfloat16 copy of its weight
that steps of few rows use on a CPU.

A decode step of a few sequences does little arithmetic per weight and
streams every weight from memory once: it costs what the weights weigh. On
a CPU with AVX-512 (the rule is ModelConfig.keeps_bfloat16_decode_weights),
a bfloat16 model, and a float32 model from a bfloat16 checkpoint (float32
is what --dtype auto picks where bfloat16 is only emulated), keep an exact
bfloat16 copy of each linear weight beside the model's, packed in panels
for `csrc/linear_bf16_weight_cpu.cpp`; steps of up to DECODE_ROWS rows
multiply it there, with float32 sums: half the bytes of float32,
and register tiling that beats the library GEMM's call at these sizes.
Larger steps (prefill) stay with the library GEMM: MKL for float32, and
for a bfloat16 model on a CPU with native bfloat16 oneDNN with the weight
reordered once at load into its blocked layout (`prepack_prefill_weights`),
which F.linear would do again on every call. On AMX, oneDNN's tiles beat the
copy from a few rows on (AMX_DECODE_ROWS).

A bfloat16 model whose weights stay in a GGUF file's blocks
(kernels/quantized.py) multiplies them with the block kernel, which reads
a quarter of bfloat16's bytes. On AMX each such linear layer also holds the
blocks dequantized to bfloat16 in oneDNN's prepacked layout (`amx_weight`,
`keep_amx_weights`), for steps of more than AMX_BLOCK_ROWS rows, where the
block kernel's AVX512-BF16 loops are compute-bound and AMX tiles are not.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from fleet.config.cpu_class import CpuClass, cpu_class, cpu_computes_bfloat16
from fleet.kernels.cpu_extension import cpu_kernels
from fleet.kernels.quantized import dequantize_kept, quantized_linear

PANEL = 32
"""Output features per panel of a packed weight (csrc/linear_bf16_weight_cpu.cpp)."""

DECODE_ROWS = 64
"""Most rows the bfloat16 copy serves; measured with SmolLM2's shapes
(`python -P scripts/bench_linear.py`) on a 2-core AVX512-BF16 EPYC, where
the kernel multiplies bfloat16 pairs natively: against oneDNN's prepacked
bfloat16 linear 1.0-1.5x faster from 16 to 64 rows, 0.92-1.04x at 128;
against float32 MKL 1.25-2.7x faster at 32 and 64 rows. (Runs of that
noisy machine differed by up to 30 %; compare columns of one run.)"""

AMX_DECODE_ROWS = 3
"""Most rows the bfloat16 copy serves on AMX, where oneDNN's prepacked
linear multiplies on tiles. SmolLM2's linears, a forward's worth, on 2
Sapphire Rapids cores, copy against oneDNN: 1 row 20.6 / 26.9 ms, 2 rows
22.8 / 24.7, 4 rows 27.5 / 25.7, 8 rows 30.7 / 24.0, 32 rows 84.0 / 30.4."""

AMX_BLOCK_ROWS = 8
"""Most rows the GGUF block kernel serves on AMX where a layer has its
`amx_weight`. The default model's linears (Q4_1, the LM head Q8_0), a
forward's worth, on 2 Sapphire Rapids cores, blocks against oneDNN on the
bfloat16 copy: 1 row 9.9 / 28.3 ms, 4 rows 18.3 / 28.7, 8 rows 28.8 / 28.5,
16 rows 53.1 / 30.4, 32 rows 111 / 43, 128 rows 364 / 62."""

PREFILL_ROWS_HINT = 256
"""The step size oneDNN is told to choose the prepacked layout for."""


def decode_rows() -> int:
    """Most rows of a step that the bfloat16 copy serves on this CPU class."""
    return AMX_DECODE_ROWS if cpu_class() >= CpuClass.amx else DECODE_ROWS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           decode_weight: torch.Tensor | None = None, amx_weight: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out]: GGUF blocks through their kernel (or, for
    many rows on AMX, their prepacked bfloat16 copy), the bfloat16 copy for a
    few rows, else oneDNN's linear for a prepacked weight, else F.linear."""
    # A compiled graph cannot call oneDNN on a prepacked (opaque) weight: it
    # keeps to the blocks and the copy (workers/compiled_decode.py bounds its
    # steps by DECODE_ROWS).
    compiling = torch.compiler.is_compiling()
    if weight.dtype == torch.uint8:
        if amx_weight is not None and x.numel() > AMX_BLOCK_ROWS * x.shape[-1] and not compiling:
            return _onednn_linear(x, amx_weight, bias)
        return quantized_linear(x, weight, bias)
    if decode_weight is not None and x.dim() == 2 and (x.shape[0] <= decode_rows() or compiling):
        ops = cpu_kernels()
        if ops is not None:
            return ops.linear_bf16_weight(x.contiguous(), decode_weight, weight.shape[0], bias)
    if weight.is_mkldnn:
        return _onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


ONEDNN_SLOW_ROWS = range(17, 33)
"""Steps whose rows oneDNN (torch 2.13's) multiplies with a slower kernel than
it picks for 33 rows, on a prepacked bfloat16 weight on 2 Sapphire Rapids
cores: SmolLM2's gate_up at 20-32 rows 0.47 ms, at 33 rows 0.32 ms; its LM
head at 32 rows 5.9 ms, at 33 rows 3.4 ms. `_onednn_linear` pads them to 33."""


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a prepacked weight, steps of ONEDNN_SLOW_ROWS rows padded with zero rows."""
    rows = x.numel() // x.shape[-1]
    if rows not in ONEDNN_SLOW_ROWS:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    flat = x.reshape(rows, x.shape[-1])
    padded = torch.cat((flat, flat.new_zeros(ONEDNN_SLOW_ROWS.stop - rows, x.shape[-1])))
    out = torch.ops.mkldnn._linear_pointwise(padded, weight, bias, "none", [], "")[:rows]
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] -> the kernel's layout, [ceil(N / PANEL), K, PANEL] bfloat16:
    panels of PANEL output features, k-major, the last one padded with zeros."""
    out_features, in_features = weight.shape
    panels = -(-out_features // PANEL)
    padded = torch.zeros(panels * PANEL, in_features, dtype=torch.bfloat16, device=weight.device)
    padded[:out_features] = weight
    return padded.view(panels, PANEL, in_features).transpose(1, 2).contiguous()


def keep_bfloat16_decode_weights(model: torch.nn.Module) -> int:
    """Give every layer that takes one (a `decode_weight` attribute) the
    packed bfloat16 copy of its weight; returns the bytes added."""
    added = 0
    for module in model.modules():
        if hasattr(module, "decode_weight") and module.weight.dtype in (torch.float32, torch.bfloat16):
            module.decode_weight = pack_bfloat16(module.weight.detach())
            added += module.decode_weight.nbytes
    return added


def prepack_prefill_weights(model: torch.nn.Module) -> int:
    """Replace the weight of every layer that takes a decode copy by oneDNN's
    prepacked layout of it (same shape, mkldnn layout), which `linear` then
    multiplies for steps of more rows: measured on a 2-core AVX512-BF16 EPYC
    with SmolLM2, a 256-token prefill 188 -> 176 ms, outputs bit-identical.
    Weights another module shares (an LM head tied to the embedding) stay
    plain. Call after `keep_bfloat16_decode_weights`, which reads the plain
    weights; returns the number of weights prepacked: none where the CPU class
    does not compute bfloat16 natively (torch's reorder refuses bfloat16 below
    AVX-512, and oneDNN emulates it above), nor in a torch without oneDNN."""
    if not torch.backends.mkldnn.is_available() or not cpu_computes_bfloat16():
        return 0
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    prepacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (hasattr(module, "decode_weight") and weight is not None and weight.is_floating_point()
                and uses[id(weight)] == 1):
            module.weight = torch.nn.Parameter(
                torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PREFILL_ROWS_HINT), requires_grad=False
            )
            prepacked += 1
    return prepacked


def keep_amx_weights(model: torch.nn.Module) -> int:
    """Give every linear layer whose weight is kept GGUF blocks (a uint8
    weight, and an `amx_weight` slot) those blocks dequantized to bfloat16, as
    loading dequantized weights rounds them, in oneDNN's prepacked layout;
    returns the bytes added (none in a torch without oneDNN). The blocks stay:
    `linear` multiplies them for steps of few rows."""
    if not torch.backends.mkldnn.is_available():
        return 0
    added = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "amx_weight") and weight is not None and weight.dtype == torch.uint8:
            dense = dequantize_kept(weight, torch.bfloat16)
            module.amx_weight = torch.ops.mkldnn._reorder_linear_weight(dense, PREFILL_ROWS_HINT)
            added += dense.nbytes
    return added
