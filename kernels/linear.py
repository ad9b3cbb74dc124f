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
which F.linear would do again on every call.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.kernels.cpu_extension import cpu_kernels
from fleet.kernels.quantized import quantized_linear

PANEL = 32
"""Output features per panel of a packed weight (csrc/linear_bf16_weight_cpu.cpp)."""

DECODE_ROWS = 64
"""Most rows the bfloat16 copy serves; measured with SmolLM2's shapes
(`python -P scripts/bench_linear.py`) on a 2-core AVX512-BF16 EPYC, where
the kernel multiplies bfloat16 pairs natively: against oneDNN's prepacked
bfloat16 linear 1.0-1.5x faster from 16 to 64 rows, 0.92-1.04x at 128;
against float32 MKL 1.25-2.7x faster at 32 and 64 rows. (Runs of that
noisy machine differed by up to 30 %; compare columns of one run.)"""


PREFILL_ROWS_HINT = 256
"""The step size oneDNN is told to choose the prepacked layout for."""


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           decode_weight: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] -> [..., out]: GGUF blocks through their dequantizing
    kernel, the bfloat16 copy for a few rows, else oneDNN's linear for a
    prepacked weight, else F.linear."""
    if weight.dtype == torch.uint8:
        return quantized_linear(x, weight, bias)
    if decode_weight is not None and x.dim() == 2 and x.shape[0] <= DECODE_ROWS:
        ops = cpu_kernels()
        if ops is not None:
            return ops.linear_bf16_weight(x.contiguous(), decode_weight, weight.shape[0], bias)
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


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
