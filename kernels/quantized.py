"""GGUF weights kept in their quantized blocks: Q4_0, Q4_1, Q8_0 (blocks of
32 weights) and the K-quants Q4_K, Q5_K, Q6_K (super-blocks of 256, what a
Q4_K_M file holds).

A GGUF file's tensors reach the model's loaders as `GGUFWeight`s: the
file's bytes, one row of blocks per output feature, sliced like the float
tensor they stand for. Where `ModelConfig.keeps_gguf_blocks` says so,
`keep_quantized` turns every linear or embedding weight that can stay
quantized into a uint8 parameter of those bytes before loading
(`param.gguf_type` says which blocks, `param.gguf_shape` what they stand
for); the loaders then copy bytes. On a CPU `pack_kept_weights` rearranges
the 32-weight types into the panels that `csrc/gguf_linear_cpu.cpp` reads,
while the K-quants stay as the file rows them, for
`csrc/gguf_kquant_cpu.cpp`; on CUDA only the 32-weight types are kept, as
the file rows them, for `triton_ops.gguf_linear`, which reads no K-quants:
CUDA dequantizes those at load. `linear` (kernels/linear.py) and the
embedding call `quantized_linear` and `quantized_embedding`. The default
model, SmolLM2-135M Q4_1, then holds 92 MiB of weights instead of 260 MiB
of bfloat16 plus its bfloat16 decode copy. Everything else (other
quantization types, a tensor-parallel slice that splits a block, a fused
projection whose parts have different types, K-quants on CUDA) is
dequantized at load into gguf-py's values.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from fleet.kernels.cpu_extension import cpu_kernels


class BlockFormat(NamedTuple):
    """How a GGUF quantization type stores its weights."""

    name: str
    nbytes: int
    """Bytes per block."""
    weights: int
    """Weights per block."""


KEPT_TYPES = {
    2: BlockFormat("Q4_0", 18, 32), 3: BlockFormat("Q4_1", 20, 32), 8: BlockFormat("Q8_0", 34, 32),
    12: BlockFormat("Q4_K", 144, 256), 13: BlockFormat("Q5_K", 176, 256), 14: BlockFormat("Q6_K", 210, 256),
}
"""GGML quantization type -> its blocks, for the types the kernels multiply
(triton_ops reads a 32-weight type's bytes per block as `KEPT_TYPES[type][1]`)."""

K_QUANTS = frozenset({12, 13, 14})
"""The kept types in 256-weight super-blocks: multiplied on a CPU only
(csrc/gguf_kquant_cpu.cpp), in the file's rows. The Triton kernel reads only
the 32-weight types, so CUDA dequantizes these at load."""


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
        """Whether a CPU kernel can multiply these blocks as they are (on CUDA only the 32-weight types)."""
        return self.gguf_type in KEPT_TYPES and self.shape[1] % KEPT_TYPES[self.gguf_type].weights == 0

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
        (computed by gguf-py itself for the K-quants and unkept types)."""
        if self.gguf_type in KEPT_TYPES and self.gguf_type not in K_QUANTS:
            return dequantize_rows(self.data, self.gguf_type, self.shape[1], dtype)
        import gguf  # deferred: only GGUF models need it

        array = gguf.quants.dequantize(self.data.numpy(), gguf.GGMLQuantizationType(self.gguf_type))
        return torch.from_numpy(np.ascontiguousarray(array)).reshape(self.shape).to(dtype)


def dequantize_rows(rows: torch.Tensor, gguf_type: int, columns: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows of a 32-weight type's blocks (uint8 [T, bytes], any device) -> [T,
    columns] in `dtype`, as gguf-py computes them: d * q is exact in float32,
    so adding m rounds once."""
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
    (gguf_kquant_linear); on CUDA the file's rows of blocks (Triton)."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if weight.is_cuda:
        from fleet.kernels import triton_ops

        out = triton_ops.gguf_linear(rows, weight, weight.gguf_type, bias)
    elif weight.gguf_type in K_QUANTS:
        out = cpu_kernels().gguf_kquant_linear(rows, weight, weight.gguf_type, weight.gguf_shape[0], bias)
    else:
        out = cpu_kernels().gguf_linear(rows, weight, weight.gguf_type, weight.gguf_shape[0], bias)
    return out.view(*x.shape[:-1], out.shape[-1])


def quantized_embedding(ids: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The rows `ids` of a kept embedding table, dequantized: [T, dim]."""
    if weight.is_cuda:
        return dequantize_rows(weight.index_select(0, ids), weight.gguf_type, weight.gguf_shape[1], dtype)
    return _cpu_rows(weight, ids.long(), dtype)


def dequantize_kept(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The whole float weight [N, K] that a kept CPU weight stands for, in `dtype`."""
    return _cpu_rows(weight, torch.arange(weight.gguf_shape[0]), dtype)


def _cpu_rows(weight: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a kept CPU weight (packed panels or K-quant rows), dequantized: [len(ids), K]."""
    if weight.gguf_type in K_QUANTS:
        return cpu_kernels().gguf_kquant_rows(weight, weight.gguf_type, weight.gguf_shape[1], ids, dtype)
    return cpu_kernels().gguf_rows(weight, weight.gguf_type, weight.gguf_shape[1], ids, dtype)


def keep_quantized(model: nn.Module, weights: Iterable[tuple[str, Any]]) -> int:
    """Turn into uint8 block parameters the weights of `model` that can stay
    quantized: those of its linear and embedding layers (modules with a true
    `keeps_gguf_blocks`) whose checkpoint tensors (several for a fused
    projection) are all of one kept type, with whole blocks per rank; on
    CUDA not the K-quants, which its kernel does not read. The parameter
    objects stay the same (a tied LM head keeps its tie). Returns the number
    of parameters turned."""
    on_cpu = next(model.parameters()).device.type == "cpu"
    if on_cpu and cpu_kernels() is None:
        return 0
    types: dict[str, set[int | None]] = defaultdict(set)
    for hf_name, weight in weights:
        name, _ = model.param_name(hf_name)
        kept = isinstance(weight, GGUFWeight) and weight.is_kept and (on_cpu or weight.gguf_type not in K_QUANTS)
        types[name].add(weight.gguf_type if kept else None)
    turned = 0
    for module_name, module in model.named_modules():
        param = getattr(module, "weight", None) if getattr(module, "keeps_gguf_blocks", False) else None
        kinds = types.get(f"{module_name}.weight" if module_name else "weight", {None})
        if param is None or param.dtype == torch.uint8 or len(kinds) != 1 or None in kinds:
            continue
        (gguf_type,) = kinds
        rows, columns = param.shape
        block = KEPT_TYPES[gguf_type]
        if columns % block.weights:
            continue
        param.data = torch.empty(rows, columns // block.weights * block.nbytes, dtype=torch.uint8,
                                 device=param.device)
        param.gguf_type, param.gguf_shape = gguf_type, (rows, columns)
        turned += 1
    return turned


def pack_kept_weights(model: nn.Module) -> None:
    """After loading: rearrange every kept CPU weight of a 32-weight type,
    copied as the file rows it, into the panels its kernel reads
    (csrc/gguf_linear_cpu.cpp). K-quants stay in the file's rows, which
    csrc/gguf_kquant_cpu.cpp reads, and so do CUDA weights, for Triton."""
    for param in model.parameters():
        kept = param.dtype == torch.uint8 and hasattr(param, "gguf_type")
        if kept and param.device.type == "cpu" and param.gguf_type not in K_QUANTS:
            param.data = cpu_kernels().gguf_pack(param.data, param.gguf_type, param.gguf_shape[1])
