"""Attention over a paged KV cache.

Two implementations behind `paged_attention`:
- on CPU tensors, a fused C++ kernel (`csrc/paged_attention_cpu.cpp`, built on
  first use by `cpu_extension`) that reads K/V straight from the cache blocks,
  for every token of the batch in one call;
- the torch-native version below (any device; the fallback when the kernel
  cannot be built or does not apply, and the oracle in tests).
`set_cpu_kernels_enabled(False)` forces the torch-native version.

KV cache of one layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). Token `pos` of a sequence lives in slot
`block_table[pos // block_size] * block_size + pos % block_size`.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
import torch.nn.functional as F

from fleet.kernels.cpu_extension import cpu_kernels

_FUSED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_cpu_kernels_enabled = True


def set_cpu_kernels_enabled(enabled: bool) -> None:
    """Use the fused C++ kernel on CPU tensors (the default), or only the
    torch-native code: tests flip this to compare the two on the same inputs."""
    global _cpu_kernels_enabled
    _cpu_kernels_enabled = enabled


def triton_kernels(*tensors: torch.Tensor):
    """kernels/triton_ops.py for CUDA tensors (each with a contiguous last
    dim) when Triton is installed (the `triton` extra); else None, and the
    torch-native code runs."""
    if not all(t.is_cuda and t.stride(-1) == 1 for t in tensors):
        return None
    try:
        from fleet.kernels import triton_ops
    except ImportError:
        return None
    return triton_ops


def elementwise_cpu_ops(x: torch.Tensor, *others: torch.Tensor):
    """`torch.ops.fleet_cpu` for the fused elementwise kernels (rms_norm,
    fused_add_rms_norm, silu_and_mul) when enabled, built and fit for these
    tensors (CPU, one supported dtype, contiguous last dim, no autograd); else None."""
    tensors = (x, *others)
    fits = (
        _cpu_kernels_enabled
        and x.dtype in _FUSED_DTYPES
        and all(t.device.type == "cpu" and t.dtype == x.dtype and t.dim() >= 1 and t.stride(-1) == 1
                for t in tensors)
        and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))
    )
    return cpu_kernels() if fits else None


@dataclass
class AttentionMetadata:
    """Where the tokens of one forward pass live in the paged KV cache.

    Built by the model runner once per step, shared by every layer.

    Batch order contract: the first `num_decode_seqs` sequences are decodes
    (query length 1, context in the cache); every later sequence is a prefill
    or a chunk of one (query length >= 1, possibly with cached context from an
    earlier chunk or a prefix-cache hit). Tokens are flattened in batch order:

        tokens:  | d0 | d1 | p0 p0 p0 p0 | p1 p1 |
        seq:       0    1    2             3        (num_decode_seqs = 2)

    Tensor fields live on the model's device; the `*_list`/int fields are the
    same facts on the host, so that no kernel has to read a device tensor back.
    """

    slot_mapping: torch.Tensor
    """int64 [num_tokens]: cache slot (block_id * block_size + offset) of each new token."""
    query_start_loc: torch.Tensor
    """int32 [num_seqs + 1]: where each sequence's tokens start in the flattened batch."""
    seq_lens: torch.Tensor
    """int32 [num_seqs]: tokens of each sequence after this step, context included."""
    block_tables: torch.Tensor
    """int32 [num_seqs, max_blocks_per_seq]: block ids of each sequence, padded with 0."""
    query_lens: list[int]
    """Host copy: new tokens of each sequence this step."""
    seq_lens_list: list[int]
    """Host copy of seq_lens."""
    num_decode_seqs: int
    """How many leading sequences are decodes (query length 1)."""
    decodes_only: bool
    """Every sequence is a decode (num_decode_seqs == num_seqs). The kernels
    branch on this flag, not on the two counts: a compiled decode graph
    (workers/compiled_decode.py) then serves any number of sequences."""

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decode_seqs

    @cached_property
    def _token_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per new token: its sequence, and how many tokens it attends to (its
        position + 1), both int32 [num_tokens]. Built on first use, once per
        step: every layer reuses them."""
        seq_index = np.repeat(np.arange(len(self.query_lens), dtype=np.int32), self.query_lens)
        kv_lens = (token_positions(self.query_lens, self.seq_lens_list) + 1).astype(np.int32)
        device = self.seq_lens.device
        return torch.from_numpy(seq_index).to(device), torch.from_numpy(kv_lens).to(device)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Metadata from host lists, the one builder (the model runner's step
        batch and the tests use it alike); the decode prefix is counted from
        `query_lens`. Computed with numpy on the host, no per-token Python
        loop, then moved to `device`."""
        assert len(query_lens) == len(seq_lens) == len(block_tables), (len(query_lens), len(seq_lens))
        num_decode_seqs = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        width = max((len(table) for table in block_tables), default=0) or 1
        tables = np.zeros((len(block_tables), width), dtype=np.int32)
        for i, table in enumerate(block_tables):
            tables[i, : len(table)] = table
        positions = token_positions(query_lens, seq_lens)
        seq_of_token = np.repeat(np.arange(len(query_lens)), query_lens)
        slots = tables[seq_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size
        starts = np.zeros(len(query_lens) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=starts[1:])

        def to(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(array).to(device, non_blocking=True)

        return cls(
            slot_mapping=to(slots),
            query_start_loc=to(starts),
            seq_lens=to(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=to(tables),
            query_lens=list(query_lens),
            seq_lens_list=list(seq_lens),
            num_decode_seqs=num_decode_seqs,
            decodes_only=num_decode_seqs == len(query_lens),
        )


def token_positions(query_lens: Sequence[int], seq_lens: Sequence[int]) -> np.ndarray:
    """Position in its sequence of every new token: int64 [num_tokens].

    The new tokens of a sequence are its last `query_len` ones.
    """
    q_lens = np.asarray(query_lens, dtype=np.int64)
    s_lens = np.asarray(seq_lens, dtype=np.int64)
    starts = np.cumsum(q_lens) - q_lens  # where each sequence's tokens start
    # token j of sequence i sits at (s_i - q_i) + (j - start_i)
    return np.arange(int(q_lens.sum()), dtype=np.int64) + np.repeat(s_lens - q_lens - starts, q_lens)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys/values ([T, KVH, D]) at their slots."""
    triton = triton_kernels(key, value, kv_cache)
    if triton is not None and kv_cache.is_contiguous():
        triton.write_kv_cache(key, value, kv_cache, slot_mapping)
        return
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, key.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(kv_cache.dtype))


def rotate_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                     kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                     num_kv_heads: int) -> torch.Tensor | None:
    """Where the fused CPU kernels apply: rotate the queries and keys in place
    in the QKV projection's output [T, (H + 2 KVH) D], write keys and values
    to their cache slots, and return the queries [T, H, D] (a view of qkv)
    for `paged_attention(query, None, None, ...)`. One op instead of the ~20
    of kernels/rotary.py and write_kv_cache. None where they do not apply."""
    head_dim = kv_cache.shape[-1]
    query = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
    fused = _fused_cpu_ops(query, kv_cache)
    if fused is None or not qkv.is_contiguous() or cos_sin_cache.dtype != qkv.dtype or qkv.shape[0] == 0:
        return None
    fused.rotary_and_cache_(qkv, positions, cos_sin_cache, kv_cache, slot_mapping, num_heads, num_kv_heads)
    return query


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's cached context
    and the new tokens up to itself (with window > 0, over the last `window`
    of them: sliding-window attention, a key at most window - 1 positions back).

    Args:
        query: [T, H, D]; key, value: [T, KVH, D] (H a multiple of KVH: GQA),
            or None when `rotate_and_cache` has put them in the cache already.
        kv_cache: this layer's cache, [2, num_blocks, block_size, KVH, D];
            the new keys/values are written into it first.
        meta: the batch layout (decodes first, see AttentionMetadata).
        scale: softmax scale, usually head_dim ** -0.5.
    Returns:
        [T, H, D] in query's dtype.
    """
    if query.shape[0] == 0:  # a replica's empty step in lock-step with the others
        return torch.empty_like(query)
    if key is not None:
        write_kv_cache(key, value, kv_cache, meta.slot_mapping)
    triton = triton_kernels(query, kv_cache)
    if triton is not None:  # CUDA: one kernel for decodes and prefill chunks, reading the blocks in place
        seq_index, kv_lens = meta._token_rows
        return triton.paged_attention(query, kv_cache, meta.block_tables, seq_index, kv_lens, scale, window)
    fused = _fused_cpu_ops(query, kv_cache)
    if fused is not None:
        # Decodes and prefill chunks alike: each token is a row attending to
        # the first kv_len tokens of its sequence, all of them in the cache now.
        if meta.decodes_only:  # rows are sequences
            return fused.paged_attention(query, kv_cache, meta.block_tables, meta.seq_lens, scale, None, window)
        seq_index, kv_lens = meta._token_rows
        return fused.paged_attention(query, kv_cache, meta.block_tables, kv_lens, scale, seq_index, window)
    output = torch.empty_like(query)
    num_decodes = meta.num_decode_seqs
    if num_decodes:
        output[:num_decodes] = _decode_attention(query[:num_decodes], kv_cache, meta, scale, window)
    start = num_decodes  # decodes own exactly one token each
    for seq in range(num_decodes, meta.num_seqs):
        end = start + meta.query_lens[seq]
        output[start:end] = _prefill_attention(
            query[start:end], key[start:end], value[start:end], kv_cache, meta, seq, scale, window
        )
        start = end
    return output


def _fused_cpu_ops(query: torch.Tensor, kv_cache: torch.Tensor):
    """`torch.ops.fleet_cpu` when the fused kernel is enabled, built and fit for
    these tensors (CPU, one dtype, head_dim a multiple of 16 up to 256); else None."""
    head_dim = query.shape[-1]
    fits = (
        _cpu_kernels_enabled
        and query.device.type == "cpu"
        and kv_cache.device.type == "cpu"
        and query.dtype == kv_cache.dtype
        and query.dtype in _FUSED_DTYPES
        and head_dim % 16 == 0
        and head_dim <= 256
        and query.stride(-1) == 1
        and kv_cache.is_contiguous()
    )
    return cpu_kernels() if fits else None


def _decode_attention(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int = 0
) -> torch.Tensor:
    """One query token per sequence, all sequences in one batched SDPA call."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = num_heads // num_kv_heads
    max_len = max(meta.seq_lens_list[:num_seqs])
    num_blocks = -(-max_len // block_size)
    tables = meta.block_tables[:num_seqs, :num_blocks]  # [B, nb]
    # Gathered context, padded to nb * block_size: [B, KVH, L, D]
    keys = _gather_blocks(kv_cache[0], tables).flatten(1, 2).transpose(1, 2)
    values = _gather_blocks(kv_cache[1], tables).flatten(1, 2).transpose(1, 2)
    # The query heads sharing one KV head play the role of SDPA's query
    # sequence, so GQA needs no copy of K/V: q [B, KVH, group, D].
    q = query.view(num_seqs, num_kv_heads, group, head_dim)
    length = keys.shape[2]
    key_pos, seq_lens = torch.arange(length, device=query.device), meta.seq_lens[:num_seqs, None]
    valid = key_pos < seq_lens  # [B, L]
    if window:
        valid &= key_pos >= seq_lens - window
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=valid[:, None, None, :], scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention for one sequence's chunk of query_len tokens: [Q, H, D]."""
    query_len, seq_len = meta.query_lens[seq], meta.seq_lens_list[seq]
    context_len = seq_len - query_len
    q = query.transpose(0, 1)  # [H, Q, D]
    if context_len == 0 and not (window and query_len > window):
        # Everything attended to is new: no need to read the cache back.
        k, v = key.transpose(0, 1), value.transpose(0, 1)  # [KVH, Q, D]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        return out.transpose(0, 1)
    block_size = kv_cache.shape[2]
    tables = meta.block_tables[seq, : -(-seq_len // block_size)]  # [nb]
    k = _gather_blocks(kv_cache[0], tables).flatten(0, 1)[:seq_len].transpose(0, 1)  # [KVH, S, D]
    v = _gather_blocks(kv_cache[1], tables).flatten(0, 1)[:seq_len].transpose(0, 1)
    # Query i sits at position context_len + i and sees keys 0..context_len + i.
    query_pos = torch.arange(context_len, seq_len, device=query.device)
    key_pos = torch.arange(seq_len, device=query.device)
    causal = key_pos[None, :] <= query_pos[:, None]  # [Q, S]
    if window:
        causal &= key_pos[None, :] > query_pos[:, None] - window
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """cache [num_blocks, block_size, KVH, D], tables [...] -> [..., block_size, KVH, D].

    index_select on the flattened ids: several times faster on CPU than
    advanced indexing with a 2-D index. Each block is copied as one row of
    int64 words, not as bf16 elements: index_select's bf16 path is ~3x slower.
    """
    rows = cache.view(cache.shape[0], -1)
    if rows.shape[1] * rows.element_size() % 8 == 0:
        rows = rows.view(torch.int64)
    blocks = rows.index_select(0, tables.flatten()).view(cache.dtype)
    return blocks.view(*tables.shape, *cache.shape[1:])
