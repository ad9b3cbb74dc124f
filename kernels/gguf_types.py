"""GGUF tensor types, and which of them fleet's kernels multiply in their
blocks on each device. Imports no torch: the memory plan (core/launch/memory.py)
reads it as kernels/quantized.py does."""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


class BlockFormat(NamedTuple):
    """How a GGUF quantization type stores its weights."""

    name: str
    nbytes: int
    """Bytes per block."""
    weights: int
    """Weights per block."""


KEPT_TYPES = {
    2: BlockFormat("Q4_0", 18, 32), 3: BlockFormat("Q4_1", 20, 32), 6: BlockFormat("Q5_0", 22, 32),
    7: BlockFormat("Q5_1", 24, 32), 8: BlockFormat("Q8_0", 34, 32), 20: BlockFormat("IQ4_NL", 18, 32),
    10: BlockFormat("Q2_K", 84, 256), 11: BlockFormat("Q3_K", 110, 256), 12: BlockFormat("Q4_K", 144, 256),
    13: BlockFormat("Q5_K", 176, 256), 14: BlockFormat("Q6_K", 210, 256), 23: BlockFormat("IQ4_XS", 136, 256),
}
"""GGML quantization type -> its blocks, for the types a CPU kernel multiplies:
the 32-weight ones in csrc/gguf_linear_cpu.cpp, the K-quants in csrc/gguf_kquant_cpu.cpp
(triton_ops reads a Triton type's bytes per block as `KEPT_TYPES[type][1]`)."""

K_QUANTS = frozenset({10, 11, 12, 13, 14, 23})
"""The kept types in 256-weight super-blocks (the K-quants Q2_K to Q6_K, and
IQ4_XS, laid out as one): multiplied in the file's rows, not in panels."""

TRITON_TYPES = frozenset({2, 3, 8})
"""The types `triton_ops.gguf_linear` reads (and `quantized.dequantize_rows`):
CUDA keeps only these; it dequantizes the others (K_QUANTS, Q5_0, Q5_1,
IQ4_NL) at load."""

DEQUANTIZE_SCRATCH_BYTES = 8 * 2**20
"""The buffer a bfloat16 K-quant prefill dequantizes its weight into, a run
of rows at a time. A fresh tensor of the whole weight costs more than the
dequantization: at 32 MiB and up glibc maps it anew (workers/cpu_heap.py),
and touching its pages took 10 of the 13 ms of a 8192x2048 Q4_K's
dequantization. Runs of 8 MiB (4096 rows of 2048) are read back from cache
by the GEMM: at 256 rows, Q4_K 16384x2048 takes 24.2 ms against the whole
weight's 42.1, Q6_K 2048x8192 12.7 against 22.3, the same products; runs of
2 to 32 MiB all take within 10 % of that."""

FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
"""GGML's float types: always loaded as the model's dtype."""


def type_name(gguf_type: int) -> str:
    """GGML's name of a tensor type (Q4_K, F32, ...)."""
    if gguf_type in KEPT_TYPES:
        return KEPT_TYPES[gguf_type].name
    if gguf_type in FLOAT_TYPES:
        return FLOAT_TYPES[gguf_type]
    import gguf  # deferred: its table names every other type

    return gguf.GGMLQuantizationType(gguf_type).name


def keeps_type(gguf_type: int, columns: int, device: str) -> bool:
    """Whether a `device` ("cpu" or "cuda") kernel multiplies rows of `columns`
    weights of this type in their blocks (a model that keeps blocks at all:
    ModelConfig.keeps_gguf_blocks)."""
    if gguf_type not in KEPT_TYPES or columns % KEPT_TYPES[gguf_type].weights:
        return False
    return device == "cpu" or gguf_type in TRITON_TYPES


@dataclass
class TypeHolding:
    """How a model holds the tensors of one GGUF type: kept in their blocks,
    or loaded as the model's dtype (every float tensor, and the blocks that no
    kernel there multiplies)."""

    kept: int = 0
    """Tensors kept in their blocks."""
    kept_bytes: int = 0
    """Their bytes: the file's."""
    kept_weights: int = 0
    dequantized: int = 0
    """Tensors loaded as the model's dtype."""
    dequantized_weights: int = 0

    def add(self, weights: int, file_bytes: int, kept: bool) -> None:
        """Count one tensor of `weights` weights and `file_bytes` bytes in the file."""
        if kept:
            self.kept += 1
            self.kept_bytes += file_bytes
            self.kept_weights += weights
        else:
            self.dequantized += 1
            self.dequantized_weights += weights

    def summary(self, dtype: str, dtype_bytes: int) -> dict[str, int]:
        """What `fleet plan` shows of it: counts and bytes, by how they are held."""
        return {"kept_in_blocks": self.kept, "kept_bytes": self.kept_bytes, f"as_{dtype}": self.dequantized,
                f"{dtype}_bytes": self.dequantized_weights * dtype_bytes}


def describe_holding(holding: dict[str, TypeHolding], dtype: str, dtype_bytes: int) -> str:
    """One line: 'Q4_K 97 kept in blocks (48.1 MiB), Q6_K ..., F32 45 as float32 (0.1 MiB)'."""
    parts = []
    for name, held in holding.items():
        ways = []
        if held.kept:
            ways.append(f"{held.kept} kept in blocks ({held.kept_bytes / 2**20:.1f} MiB)")
        if held.dequantized:
            what = "as" if name in FLOAT_TYPES.values() else "dequantized to"
            ways.append(f"{held.dequantized} {what} {dtype} ({held.dequantized_weights * dtype_bytes / 2**20:.1f} MiB)")
        parts.append(f"{name} {', '.join(ways)}")
    return ", ".join(parts)


def planned_holding(tensors: Iterable[tuple[int, tuple[int, ...], int]], device: str,
                    keeps_blocks: bool) -> dict[str, TypeHolding]:
    """GGUF type name -> how a model on `device` will hold its tensors, from the
    file's (type, shape, bytes) alone: a matrix of a type kept there stays in
    its blocks where the model keeps blocks at all. (A fused projection with a
    part of an unkept type, or a tensor-parallel slice that splits a block, is
    dequantized whole at load: this counts it as kept.)"""
    holding: dict[str, TypeHolding] = {}
    for gguf_type, shape, nbytes in tensors:
        kept = keeps_blocks and len(shape) == 2 and keeps_type(gguf_type, shape[-1], device)
        holding.setdefault(type_name(gguf_type), TypeHolding()).add(math.prod(shape), nbytes, kept)
    return holding
