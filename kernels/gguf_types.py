"""GGUF tensor types, and which of them fleet's kernels multiply in their
blocks on each device. Imports no torch: the memory plan (workers/memory.py)
reads it as kernels/quantized.py does."""
from __future__ import annotations

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
    12: BlockFormat("Q4_K", 144, 256), 13: BlockFormat("Q5_K", 176, 256), 14: BlockFormat("Q6_K", 210, 256),
}
"""GGML quantization type -> its blocks, for the types a CPU kernel multiplies:
the 32-weight ones in csrc/gguf_linear_cpu.cpp, the K-quants in csrc/gguf_kquant_cpu.cpp
(triton_ops reads a Triton type's bytes per block as `KEPT_TYPES[type][1]`)."""

K_QUANTS = frozenset({12, 13, 14})
"""The kept types in 256-weight super-blocks: multiplied in the file's rows, not in panels."""

TRITON_TYPES = frozenset({2, 3, 8})
"""The types `triton_ops.gguf_linear` reads (and `quantized.dequantize_rows`):
CUDA keeps only these; it dequantizes the others (K-quants, Q5_0, Q5_1,
IQ4_NL) at load."""

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

