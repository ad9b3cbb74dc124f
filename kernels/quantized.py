"""GGUF weights kept in their quantized blocks: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
IQ4_NL (blocks of 32 weights) and the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
and IQ4_XS (super-blocks of 256, what the Q2_K to Q6_K and IQ4_XS files
hold, with Q5_0 / Q8_0 where a row is not a multiple of 256);
kernels/gguf_types.py lists them.

A GGUF file's tensors reach the model's loaders as `GGUFWeight`s: the
file's bytes, one row of blocks per output feature, sliced like the float
tensor they stand for. Where `ModelConfig.keeps_gguf_blocks` says so,
`keep_quantized` turns every linear or embedding weight that can stay
quantized into a uint8 parameter of those bytes before loading
(`param.gguf_type` says which blocks, `param.gguf_shape` what they stand
for); the loaders then copy bytes. On a CPU `pack_kept_weights` rearranges
the 32-weight types into the panels that `csrc/gguf_linear_cpu.cpp` reads,
while the K-quants stay as the file rows them, for
`csrc/gguf_kquant_integer_cpu.cpp` (steps of up to KQUANT_INTEGER_ROWS rows,
in integers against activations rounded to Q8_K) and `csrc/gguf_kquant_cpu.cpp`
(float32 tiles, larger steps), `quantized_linear` choosing between them; on
CUDA only Q4_0, Q4_1 and Q8_0 are kept (TRITON_TYPES), as the file rows them,
for `triton_ops.gguf_linear`, which reads no others: CUDA dequantizes those at
load. `linear` (kernels/linear.py) and the embedding call `quantized_linear` and
`quantized_embedding`. The default model, SmolLM2-135M Q4_1, then holds 92
MiB of weights instead of 260 MiB of bfloat16 plus its bfloat16 decode copy.

A fused projection (qkv_proj, gate_up_proj) whose parts are of different
kept types (Q4_K_M's Q4_K q/k beside a Q6_K v) keeps each run of rows of one
type as its own part: one uint8 parameter holds all their bytes, and
`param.gguf_parts` are views of it, each with its `gguf_type`,
`gguf_shape` and `gguf_rows` (its rows of the fused output);
`quantized_linear` multiplies each part into its slice of the output.
Everything else (other quantization types, a tensor-parallel slice that
splits a block, a fused projection with a part of an unkept type) is
dequantized at load into gguf-py's values.
"""
from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.kernels.cpu_extension import cpu_kernels
from fleet.kernels.gguf_types import (
    DEQUANTIZE_SCRATCH_BYTES, K_QUANTS, KEPT_TYPES, TRITON_TYPES, TypeHolding, keeps_type, type_name,
)


@dataclass
class GGUFWeight:
    """One quantized GGUF tensor, or a slice of it, standing in for the float
    tensor of `shape` ([rows, columns], torch's order) in a weight loader."""

    gguf_type: int
    data: torch.Tensor
    """uint8 [rows, bytes per row]: the file's blocks (a view of its mapping until copied)."""
    shape: tuple[int, int]

    @property
    def is_kept(self) -> bool:
        """Whether a CPU kernel can multiply these blocks as they are (`keeps_on` says for CUDA)."""
        return self.keeps_on("cpu")

    def keeps_on(self, device: str) -> bool:
        """Whether a kernel of `device` ("cpu", "cuda") multiplies these blocks as they are."""
        return keeps_type(self.gguf_type, self.shape[1], device)

    def __getitem__(self, index: Any) -> GGUFWeight | torch.Tensor:
        """Rows `[a:b]`, or columns `[:, a:b]`: blocks when the columns are whole
        blocks, else the dequantized float32 slice."""
        rows, columns = index if isinstance(index, tuple) else (index, slice(None))
        rows = range(self.shape[0])[rows]
        columns = range(self.shape[1])[columns]
        assert rows.step == 1 and columns.step == 1, "weight loaders slice contiguous ranges"
        block = KEPT_TYPES.get(self.gguf_type)
        if not self.is_kept or columns.start % block.weights or len(columns) % block.weights:
            return self.dequantize(torch.float32)[rows.start : rows.stop, columns.start : columns.stop]
        start, stop = (column // block.weights * block.nbytes for column in (columns.start, columns.stop))
        data = self.data[rows.start : rows.stop, start:stop]
        return GGUFWeight(self.gguf_type, data, (len(rows), len(columns)))

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float tensor these blocks stand for, in `dtype`: gguf-py's values
        (computed by gguf-py itself for the types dequantize_rows does not read)."""
        if self.gguf_type in TRITON_TYPES:
            return dequantize_rows(self.data, self.gguf_type, self.shape[1], dtype)
        import gguf  # deferred: only GGUF models need it

        array = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType(self.gguf_type))
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(self.shape).to(dtype)


def dequantize_rows(rows: torch.Tensor, gguf_type: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of Q4_0, Q4_1 or Q8_0 blocks (TRITON_TYPES: the types CUDA keeps;
    uint8 [T, bytes], any device) -> [T, columns] in `dtype`, as gguf-py
    computes them: d * q is exact in float32, so adding m rounds once."""
    name, nbytes, block = KEPT_TYPES[gguf_type]
    blocks = rows.reshape(rows.shape[0], columns // block, nbytes)
    scale = blocks[..., 0:2].contiguous().view(torch.float16).float()  # [T, blocks, 1]
    if name == "Q8_0":
        weights = blocks[..., 2:].contiguous().view(torch.int8).float() * scale
    else:
        nibbles = blocks[..., -16:]  # byte j: input j (low nibble), j + 16 (high)
        q = torch.cat((nibbles & 0xF, nibbles >> 4), dim=-1).float()
        if name == "Q4_1":
            weights = q * scale + blocks[..., 2:4].contiguous().view(torch.float16).float()
        else:
            weights = (q - 8) * scale
    return weights.reshape(rows.shape[0], columns).to(dtype)


def copy_weight(dst: torch.Tensor, src: Any) -> torch.Tensor:
    """What a loader copies into `dst` for the checkpoint slice `src`: the
    blocks into a kept (uint8) parameter, else a float tensor."""
    if isinstance(src, GGUFWeight):
        return src.data if dst.dtype == torch.uint8 else src.dequantize(dst.dtype)
    return src


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] -> [..., N] for a kept weight: on a CPU its blocks packed in
    panels (gguf_linear) or, for a K-quant, the file's rows of super-blocks
    (`_kquant_linear`); on CUDA the file's rows of blocks (Triton). A weight
    of parts multiplies each into its slice of the output."""
    parts = getattr(weight, "gguf_parts", None)
    if parts is not None:
        return torch.cat([quantized_linear(x, part, None if bias is None else bias[slice(*part.gguf_rows)])
                          for part in parts], dim=-1)
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if weight.is_cuda:
        from fleet.kernels import triton_ops

        out = triton_ops.gguf_linear(rows, weight, weight.gguf_type, bias)
    elif weight.gguf_type in K_QUANTS:
        out = _kquant_linear(rows, weight, bias)
    else:
        out = cpu_kernels().gguf_linear(rows, weight, weight.gguf_type, weight.gguf_shape[0], bias)
    return out.view(*x.shape[:-1], out.shape[-1])


KQUANT_INTEGER_ROWS = 32
"""Most rows a K-quant step rounds to Q8_K and multiplies in integers, where
the class has that path; larger steps (prefill) keep the dequantized model's
products. The bound is not speed: the integer path is the faster at every size
measured (1 thread, weights in L2, ns per super-block and row of x, Q4_K:
rows 8 / 32 / 128 take 2.6 / 2.6 / 2.7 integer vs 6.9 / 4.7 / 4.4 float on the
Zen 4's class; 3.6 / 3.5 / 3.6 vs 9.1 / 6.5 / 9.4 held to avx2; Q5_K and Q6_K
alike). It is where steps stop being decode, as csrc/gguf_linear_cpu.cpp's
Q8_ROWS: a prefill keeps transformers' logits at ~1.7x the integer path's time."""


def _kquant_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] times a K-quant weight by the path its step takes: integers
    (few rows, a class with the path), oneDNN on the weight dequantized to
    bfloat16 (a bfloat16 prefill on native bfloat16), else the float32 tiles."""
    if _dequantizes_for_onednn(rows):
        return _dequantized_linear(rows, weight, bias)
    integer = rows.shape[0] <= KQUANT_INTEGER_ROWS and kquant_integer_compiled()
    return cpu_kernels().gguf_kquant_linear_by(rows, weight, weight.gguf_type, weight.gguf_shape[0], bias, integer)


@functools.cache
def kquant_integer_compiled() -> bool:
    """Whether the CPU kernels, as built for this CPU class, have the K-quants' integer path (AVX2 and up)."""
    return cpu_kernels().gguf_kquant_integer_compiled()


def _dequantizes_for_onednn(rows: torch.Tensor) -> bool:
    """Whether a K-quant prefill step of a bfloat16 model on a CPU with native
    bfloat16 dequantizes the weight to bfloat16 for this call and runs oneDNN's
    GEMM: the products of the weights rounded to bfloat16, exactly what the
    kernel's float32 tiles compute, at over three times their speed. At 256
    rows on the 2-core Zen 4: Q4_K 16384x2048 24.2 ms against the tiles' 80.5,
    Q6_K 2048x8192 12.7 against 40.0 (_dequantized_linear). Steps the
    integer path takes stay there."""
    return rows.shape[0] > KQUANT_INTEGER_ROWS and rows.dtype == torch.bfloat16 and cpu_computes_bfloat16()


_scratch: torch.Tensor | None = None


def _dequantized_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows x W^T (+ bias) by oneDNN's bfloat16 GEMM, on the weight dequantized
    a run of rows at a time into one buffer (DEQUANTIZE_SCRATCH_BYTES)."""
    global _scratch
    if _scratch is None:
        _scratch = torch.empty(DEQUANTIZE_SCRATCH_BYTES // 2, dtype=torch.bfloat16)
    num_features, num_inputs = weight.gguf_shape
    run = max(1, _scratch.numel() // num_inputs)

    def dequantized(first: int, size: int) -> torch.Tensor:
        view = _scratch[: size * num_inputs].view(size, num_inputs)
        cpu_kernels().gguf_kquant_dequantize_into(weight, weight.gguf_type, first, view)
        return view

    if run >= num_features:  # one run: no output to assemble
        return F.linear(rows, dequantized(0, num_features), bias)
    out = torch.empty(rows.shape[0], num_features, dtype=rows.dtype)
    for first in range(0, num_features, run):
        size = min(run, num_features - first)
        out[:, first : first + size] = F.linear(rows, dequantized(first, size),
                                                None if bias is None else bias[first : first + size])
    return out


def quantized_embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows `ids` of a kept embedding table, dequantized: [T, dim]."""
    if weight.is_cuda:
        return dequantize_rows(weight.index_select(0, ids), weight.gguf_type, weight.gguf_shape[1], dtype)
    return _cpu_rows(weight, ids.long(), dtype)


def dequantize_kept(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole float weight [N, K] that a kept CPU weight stands for, in `dtype`."""
    parts = getattr(weight, "gguf_parts", None)
    if parts is not None:
        return torch.cat([dequantize_kept(part, dtype) for part in parts])
    return _cpu_rows(weight, torch.arange(weight.gguf_shape[0]), dtype)


def _cpu_rows(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a kept CPU weight (packed panels or K-quant rows), dequantized: [len(ids), K]."""
    if weight.gguf_type in K_QUANTS:
        return cpu_kernels().gguf_kquant_rows(weight, weight.gguf_type, weight.gguf_shape[1], ids, dtype)
    return cpu_kernels().gguf_rows(weight, weight.gguf_type, weight.gguf_shape[1], ids, dtype)


def kept_rows(param: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Where a loader copies rows [start, start + size) of `param`: its data's
    rows, or, for a weight of parts, those of the part that holds them."""
    for part in getattr(param, "gguf_parts", ()):
        first, stop = part.gguf_rows
        if first <= start < stop:
            assert start + size <= stop, f"rows {start}..{start + size} cross parts of {param.gguf_shape}"
            return part[start - first : start - first + size]
    return param.data[start : start + size]


def keep_quantized(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> int:
    """Turn into uint8 block parameters the weights of `model` that can stay
    quantized: those of its linear and embedding layers (modules with a true
    `keeps_gguf_blocks`) whose checkpoint tensors (several for a fused
    projection) are all of kept types, with whole blocks per rank; on CUDA
    only TRITON_TYPES, which its kernel reads. A fused projection whose parts
    differ in type keeps them as parts of one parameter (`gguf_parts`). The
    parameter objects stay the same (a tied LM head keeps its tie). Returns
    the number of parameters turned."""
    device = next(model.parameters()).device.type
    if device == "cpu" and cpu_kernels() is None:
        return 0
    shards: dict[str, dict[Any, int | None]] = defaultdict(dict)  # param name -> shard id -> kept type or None
    rows_of: dict[tuple[str, Any], int] = {}
    for hf_name, weight in weights:
        name, shard_id = model.param_name(hf_name)
        kept = isinstance(weight, GGUFWeight) and weight.keeps_on(device)
        shards[name][shard_id] = weight.gguf_type if kept else None
        rows_of[name, shard_id] = weight.shape[0] if isinstance(weight, GGUFWeight) else None
    turned = 0
    for module_name, module in model.named_modules():
        param = getattr(module, "weight", None) if getattr(module, "keeps_gguf_blocks", False) else None
        name = f"{module_name}.weight" if module_name else "weight"
        types = shards.get(name, {None: None})
        if param is None or param.dtype == torch.uint8 or None in types.values():
            continue
        rows, columns = param.shape
        if any(columns % KEPT_TYPES[gguf_type].weights for gguf_type in types.values()):
            continue
        if len(set(types.values())) == 1:
            (gguf_type,) = set(types.values())
            param.data = torch.empty(rows, _row_bytes(gguf_type, columns), dtype=torch.uint8, device=param.device)
            param.gguf_type = gguf_type
        else:
            runs = _runs_of_one_type(module, {shard: (gguf_type, rows_of[name, shard])
                                              for shard, gguf_type in types.items()})
            _hold_parts(param, [torch.empty(b - a, _row_bytes(t, columns), dtype=torch.uint8) for t, (a, b) in runs],
                        [t for t, _ in runs], [rows_range for _, rows_range in runs], columns)
        param.gguf_shape = (rows, columns)
        turned += 1
    return turned


def _row_bytes(gguf_type: int, columns: int) -> int:
    block = KEPT_TYPES[gguf_type]
    return columns // block.weights * block.nbytes


def _runs_of_one_type(module: nn.Module, shards: dict[Any, tuple[int, int]]) -> list[tuple[int, tuple[int, int]]]:
    """(type, (first row, row past the run)) of each run of a fused layer's rows
    whose shards (shard id -> (type, checkpoint rows)) have one type, in row order."""
    assert None not in shards, "a fused checkpoint tensor has one type"
    spans = []
    for shard_id, (gguf_type, loaded_rows) in shards.items():
        ((start, size, _),) = module.row_copies(loaded_rows, shard_id)
        spans.append((start, start + size, gguf_type))
    runs: list[tuple[int, tuple[int, int]]] = []
    for start, stop, gguf_type in sorted(spans):
        if runs and runs[-1][0] == gguf_type and runs[-1][1][1] == start:
            runs[-1] = (gguf_type, (runs[-1][1][0], stop))
        else:
            assert not runs or runs[-1][1][1] == start, f"shards leave rows {runs[-1][1][1]}..{start} empty"
            runs.append((gguf_type, (start, stop)))
    return runs


def _hold_parts(param: torch.Tensor, parts: list[torch.Tensor], types: list[int], rows: list[tuple[int, int]],
                columns: int) -> None:
    """Make `param` one uint8 buffer of the parts' bytes, side by side, and
    `param.gguf_parts` views of it shaped as the parts."""
    param.data = torch.cat([part.reshape(-1) for part in parts]).to(param.device)
    param.gguf_type, param.gguf_parts, offset = None, [], 0
    for part, gguf_type, (first, stop) in zip(parts, types, rows, strict=True):
        view = param.data[offset : offset + part.numel()].view(part.shape)
        view.gguf_type, view.gguf_shape, view.gguf_rows = gguf_type, (stop - first, columns), (first, stop)
        param.gguf_parts.append(view)
        offset += part.numel()


def pack_kept_weights(model: nn.Module) -> None:
    """After loading: rearrange every kept CPU weight of a 32-weight type
    (or part of one), copied as the file rows it, into the panels its kernel
    reads (csrc/gguf_linear_cpu.cpp). K-quants stay in the file's rows, which
    csrc/gguf_kquant_cpu.cpp reads, and so do CUDA weights, for Triton."""
    for param in model.parameters():
        if param.dtype != torch.uint8 or not hasattr(param, "gguf_type") or param.device.type != "cpu":
            continue
        parts = getattr(param, "gguf_parts", None)
        if parts is None:
            param.data = _packed(param.data, param.gguf_type, param.gguf_shape[1])
        else:
            _hold_parts(param, [_packed(part, part.gguf_type, param.gguf_shape[1]) for part in parts],
                        [part.gguf_type for part in parts], [part.gguf_rows for part in parts], param.gguf_shape[1])


def _packed(rows: torch.Tensor, gguf_type: int, columns: int) -> torch.Tensor:
    return rows if gguf_type in K_QUANTS else cpu_kernels().gguf_pack(rows, gguf_type, columns)


_FLOAT_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
"""A GGUF file's float tensors' torch dtype -> GGML type."""


def loaded_holding(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> dict[str, TypeHolding]:
    """GGUF type name -> how `model`, loaded, holds the file's tensors `weights`
    of that type: kept in their blocks (a uint8 parameter, or a part of one),
    or as its dtype. Tensors of another pipeline stage are not counted."""
    params = dict(model.named_parameters())
    holding: dict[str, TypeHolding] = {}
    for hf_name, weight in weights:
        param = params.get(model.param_name(hf_name)[0])
        if param is None:
            continue
        if isinstance(weight, GGUFWeight):
            gguf_type, count, nbytes = weight.gguf_type, weight.shape[0] * weight.shape[1], weight.data.nbytes
        else:
            gguf_type, count, nbytes = _FLOAT_TYPES[weight.dtype], weight.numel(), weight.nbytes
        holding.setdefault(type_name(gguf_type), TypeHolding()).add(count, nbytes, param.dtype == torch.uint8)
    return holding
