"""Tensor-parallel layers: each holds only its rank's shard and loads it.

Every layer takes its rank and size from `get_tp_group()` when it is built.
Every parameter carries `weight_loader(param, loaded, shard_id=None)`, where
`loaded` is the FULL checkpoint tensor, or anything that slices like one and
knows its shape (a torch tensor, a safetensors `get_slice` object): the loader
reads only its own rows/columns, so a rank never materialises other shards.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fleet.kernels.linear import linear
from fleet.kernels.quantized import copy_weight, kept_rows, quantized_embedding
from fleet.parallel.comm import get_tp_group

WeightLoader = Callable[..., None]


def shape_of(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a safetensors slice (which only has get_shape())."""
    shape = getattr(loaded, "shape", None)
    return tuple(shape if shape is not None else loaded.get_shape())


def default_weight_loader(param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
    """Copy a replicated (unsharded) weight whole."""
    _copy_into(param.data, loaded[:], "weight")


def _copy_into(dst: torch.Tensor, src: Any, what: str) -> None:
    src = copy_weight(dst, src)
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shard has shape {tuple(src.shape)}, the layer expects {tuple(dst.shape)}")
    dst.copy_(src)


def _parameter(shape: Sequence[int], dtype: torch.dtype | None, device: torch.device | str | None,
               loader: WeightLoader) -> nn.Parameter:
    param = nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = loader
    return param


def _divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor parallel size ({parts})")
    return total // parts


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b, W's rows (output features) split across ranks.

    Output per rank: [..., output_size / tp]; `gather_output` concatenates it.
    """

    decode_weight: torch.Tensor | None = None
    """An exact bfloat16 copy of `weight` for steps of few rows (kernels/linear.py), or None."""
    amx_weight: torch.Tensor | None = None
    """Kept GGUF blocks in bfloat16, prepacked for oneDNN, for steps of many rows on AMX (kernels/linear.py)."""
    keeps_gguf_blocks = True
    """`weight` may be a GGUF file's blocks (kernels/quantized.py): `linear` multiplies them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_rank = _divide(output_size, self.tp.size, f"{type(self).__name__} output size")
        self.gather_output = gather_output
        self.weight = _parameter((self.output_size_per_rank, input_size), dtype, device, self.weight_loader)
        self.bias = _parameter((self.output_size_per_rank,), dtype, device, self.weight_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        """Weight [out, in] or bias [out]: read this rank's block of rows."""
        for dst_start, size, src_start in self.row_copies(shape_of(loaded)[0], shard_id):
            _copy_into(kept_rows(param, dst_start, size), loaded[src_start : src_start + size],
                       f"{type(self).__name__} shard {shard_id}")

    def row_copies(self, loaded_rows: int, shard_id: Any) -> list[tuple[int, int, int]]:
        """(dst_start, num_rows, src_start) of each block of rows to copy
        (kernels/quantized.py reads it too, to keep parts of differing types apart)."""
        _check_rows(loaded_rows, self.output_size, type(self).__name__)
        rows = self.output_size_per_rank
        return [(0, rows, self.tp.rank * rows)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.bias, self.decode_weight, self.amx_weight)  # [..., out / tp]
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input in one matmul (gate_up).

    Each rank holds its slice of every projection, side by side:
    [gate_shard | up_shard]. shard_id is the index in `output_sizes`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        tp_size = get_tp_group().size
        self.output_sizes = output_sizes
        for size in output_sizes:
            _divide(size, tp_size, f"{type(self).__name__} output size")
        super().__init__(input_size, sum(output_sizes), bias, dtype=dtype, device=device)

    def row_copies(self, loaded_rows: int, shard_id: int | None) -> list[tuple[int, int, int]]:
        fused = shard_id is None  # the checkpoint already holds all projections stacked
        ids = range(len(self.output_sizes)) if fused else [shard_id]
        copies = []
        for i in ids:
            offset = sum(self.output_sizes[:i])
            rows = self.output_sizes[i] // self.tp.size
            _check_rows(loaded_rows, self.output_size if fused else self.output_sizes[i], f"shard {i}")
            copies.append((offset // self.tp.size, rows, (offset if fused else 0) + self.tp.rank * rows))
        return copies


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections in one matmul: [q | k | v] per rank.

    Query heads are split across ranks; KV heads too, or, when there are fewer
    KV heads than ranks, each KV head is replicated on tp / num_kv_heads ranks.
    shard_id is "q", "k" or "v".
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        tp_size, tp_rank = get_tp_group().size, get_tp_group().rank
        if num_heads % tp_size:
            raise ValueError(
                f"the number of attention heads ({num_heads}) is not divisible by the tensor parallel size ({tp_size})"
            )
        if num_kv_heads >= tp_size:
            self.num_kv_heads_per_rank = _divide(num_kv_heads, tp_size, "the number of KV heads")
            self.kv_head_start = tp_rank * self.num_kv_heads_per_rank
        else:
            replicas = _divide(tp_size, num_kv_heads, "a tensor parallel size above the number of KV heads")
            self.num_kv_heads_per_rank = 1
            self.kv_head_start = tp_rank // replicas
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads_per_rank = num_heads // tp_size
        per_rank = (self.num_heads_per_rank + 2 * self.num_kv_heads_per_rank) * head_dim
        super().__init__(hidden_size, per_rank * tp_size, bias, dtype=dtype, device=device)

    def row_copies(self, loaded_rows: int, shard_id: str | None) -> list[tuple[int, int, int]]:
        fused = shard_id is None  # a checkpoint with a single qkv_proj
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_rank_rows, kv_rank_rows = self.num_heads_per_rank * self.head_dim, self.num_kv_heads_per_rank * self.head_dim
        kv_start = self.kv_head_start * self.head_dim
        # shard -> (rows in the checkpoint, start in a fused checkpoint, dst start, rows here, src start in shard)
        layout = {
            "q": (q_rows, 0, 0, q_rank_rows, self.tp.rank * q_rank_rows),
            "k": (kv_rows, q_rows, q_rank_rows, kv_rank_rows, kv_start),
            "v": (kv_rows, q_rows + kv_rows, q_rank_rows + kv_rank_rows, kv_rank_rows, kv_start),
        }
        _check_rows(loaded_rows, q_rows + 2 * kv_rows if fused else layout[shard_id][0], f"shard {shard_id}")
        ids = "qkv" if fused else [shard_id]
        return [(dst, rows, src + (fused_start if fused else 0))
                for _, fused_start, dst, rows, src in (layout[i] for i in ids)]


def _check_rows(loaded_rows: int, expected: int, what: str) -> None:
    if loaded_rows != expected:
        raise ValueError(f"{what}: checkpoint tensor has {loaded_rows} rows, expected {expected}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b, W's columns (input features) split across ranks.

    Input per rank: [..., input_size / tp] (a column-parallel output); the
    partial products are summed with one all-reduce, then the bias is added once.
    """

    decode_weight: torch.Tensor | None = None
    """An exact bfloat16 copy of `weight` for steps of few rows (kernels/linear.py), or None."""
    amx_weight: torch.Tensor | None = None
    """Kept GGUF blocks in bfloat16, prepacked for oneDNN, for steps of many rows on AMX (kernels/linear.py)."""
    keeps_gguf_blocks = True
    """`weight` may be a GGUF file's blocks (kernels/quantized.py): `linear` multiplies them."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.input_size_per_rank = _divide(input_size, self.tp.size, f"{type(self).__name__} input size")
        self.weight = _parameter((output_size, self.input_size_per_rank), dtype, device, self.weight_loader)
        self.bias = _parameter((output_size,), dtype, device, default_weight_loader) if bias else None

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        cols = self.input_size_per_rank
        start = self.tp.rank * cols
        _copy_into(param.data, loaded[:, start : start + cols], type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, self.decode_weight, self.amx_weight)
        y = self.tp.all_reduce(linear(x, self.weight, None, self.decode_weight, self.amx_weight))  # [..., out]
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (token ids) across ranks.

    Each rank owns ceil(vocab / tp) rows (the last rank's tail is zero
    padding); a token's vector comes from its owner, the others add zeros.
    """

    keeps_gguf_blocks = True
    """`weight` may be a GGUF file's blocks (kernels/quantized.py), dequantized per looked-up row."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *,
                 dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.tp = get_tp_group()
        self.num_embeddings = num_embeddings
        self.dtype = dtype or torch.get_default_dtype()
        self.rows_per_rank = -(-num_embeddings // self.tp.size)
        self.vocab_start = self.tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, num_embeddings)
        self.weight = _parameter((self.rows_per_rank, embedding_dim), dtype, device, self.weight_loader)

    def weight_loader(self, param: torch.Tensor, loaded: Any, shard_id: Any = None) -> None:
        _check_rows(shape_of(loaded)[0], self.num_embeddings, type(self).__name__)
        owned = self.vocab_end - self.vocab_start
        _copy_into(param.data[:owned], loaded[self.vocab_start : self.vocab_end], type(self).__name__)
        param.data[owned:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._rows(input_ids)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)  # [T]
        local_ids = (input_ids - self.vocab_start) * owned
        embeddings = self._rows(local_ids).masked_fill(~owned[:, None], 0)  # [T, dim]
        return self.tp.all_reduce(embeddings)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.uint8:
            return quantized_embedding(ids, self.weight, self.dtype)
        return F.embedding(ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection sharded like the embedding (so the two can be tied)."""

    decode_weight: torch.Tensor | None = None
    """An exact bfloat16 copy of `weight` for steps of few rows (kernels/linear.py), or None."""
    amx_weight: torch.Tensor | None = None
    """Kept GGUF blocks in bfloat16, prepacked for oneDNN, for steps of many rows on AMX (kernels/linear.py)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, dim] -> logits [N, vocab] on tensor rank 0, the one that
        samples; None on the other ranks (a gather, not an all-gather: the
        others never read them)."""
        logits = linear(hidden, self.weight, None, self.decode_weight, self.amx_weight)  # [N, rows_per_rank]
        if self.tp.size == 1:
            return logits
        gathered = self.tp.gather(logits, dst=0, dim=-1)
        return None if gathered is None else gathered[:, : self.num_embeddings]
