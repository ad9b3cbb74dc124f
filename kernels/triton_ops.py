"""Triton kernels for CUDA workers: RMSNorm (and with the residual add fused),
SiLU-and-mul, rotary embedding, writing K/V into the paged cache, and paged
attention that reads K/V straight from the block table.

The torch-level functions in kernels/ (rmsnorm.py, activation.py, rotary.py,
attention.py) call these for CUDA tensors when Triton is installed (the
`triton` extra); CPU tensors keep the C++ kernels. The tests run every kernel
in Triton's interpreter (TRITON_INTERPRET=1) on CPU tensors against the
torch-native versions, so they are checked on a machine without a GPU.

Every kernel loads in its tensors' dtype and computes in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from fleet.kernels.quantized import KEPT_TYPES


def serves(*tensors: torch.Tensor) -> bool:
    """Whether these tensors are the kernels' to take: all on a CUDA device."""
    return all(t.is_cuda for t in tensors)


# ---- RMSNorm ------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, x_stride, residual_stride,
                     out_stride, residual_out_stride, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # The sum is rounded to the activations' dtype, as the torch version adds in that dtype.
        residual = tl.load(residual_ptr + row * residual_stride + cols, mask=mask, other=0.0).to(tl.float32)
        total = (x + residual).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * residual_out_stride + cols, total, mask=mask)
        x = total.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / hidden
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = x * tl.rsqrt(variance + eps) * weight
    tl.store(out_ptr + row * out_stride + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> x * rsqrt(mean(x^2) + eps) * weight, statistics in float32."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(rows)
    _launch_rms_norm(rows, None, weight, out, None, eps)
    return out.view_as(x)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); neither input is modified."""
    rows, residual_rows = x.reshape(-1, x.shape[-1]), residual.reshape(-1, x.shape[-1])
    out, residual_out = torch.empty_like(rows), torch.empty_like(rows)
    _launch_rms_norm(rows, residual_rows, weight, out, residual_out, eps)
    return out.view_as(x), residual_out.view_as(x)


def _launch_rms_norm(rows, residual, weight, out, residual_out, eps: float) -> None:
    num_rows, hidden = rows.shape
    if num_rows == 0:
        return
    has_residual = residual is not None
    _rms_norm_kernel[(num_rows,)](
        rows, residual if has_residual else rows, weight, out, residual_out if has_residual else out,
        rows.stride(0), residual.stride(0) if has_residual else 0, out.stride(0),
        residual_out.stride(0) if has_residual else 0, hidden, eps,
        HAS_RESIDUAL=has_residual, BLOCK=triton.next_power_of_2(hidden),
    )


# ---- SiLU and mul -------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, width, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * I] (gate, then up) -> silu(gate) * up [..., I]."""
    rows = x.reshape(-1, x.shape[-1])
    width = rows.shape[1] // 2
    out = torch.empty(rows.shape[0], width, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(width))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(width, block))](
            rows, out, rows.stride(0), out.stride(0), width, BLOCK=block)
    return out.view(*x.shape[:-1], width)


# ---- rotary embedding ---------------------------------------------------------------------------


@triton.jit
def _rotary_kernel(x_ptr, positions_ptr, cache_ptr, token_stride, head_stride, cache_stride, num_heads,
                   HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS_PAD: tl.constexpr):
    token = tl.program_id(0)
    position = tl.load(positions_ptr + token)
    cols = tl.arange(0, HALF_PAD)
    heads = tl.arange(0, HEADS_PAD)
    col_mask = cols < HALF
    mask = (heads[:, None] < num_heads) & col_mask[None, :]
    cos = tl.load(cache_ptr + position * cache_stride + cols, mask=col_mask, other=0.0)
    sin = tl.load(cache_ptr + position * cache_stride + HALF + cols, mask=col_mask, other=0.0)
    first = x_ptr + token * token_stride + heads[:, None] * head_stride + cols[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


def rotate_(x: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in place by its tokens' positions [T] (NeoX
    halves; cache [max_positions, D]: cos of each angle, then sin)."""
    num_tokens, num_heads, head_dim = x.shape
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            x, positions, cache, x.stride(0), x.stride(1), cache.stride(0), num_heads,
            HALF=half, HALF_PAD=triton.next_power_of_2(half), HEADS_PAD=triton.next_power_of_2(num_heads),
        )
    return x


# ---- the paged KV cache -------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slots_ptr, key_stride, value_stride, cache_half,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token).to(tl.int64)
    cols = tl.arange(0, ROW_PAD)
    mask = cols < ROW
    key = tl.load(key_ptr + token * key_stride + cols, mask=mask)
    value = tl.load(value_ptr + token * value_stride + cols, mask=mask)
    tl.store(cache_ptr + slot * ROW + cols, key.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + cache_half + slot * ROW + cols, value.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store the new tokens' keys and values [T, KVH, D] at their slots of
    kv_cache [2, num_blocks, block_size, KVH, D] (contiguous)."""
    num_tokens = key.shape[0]
    if num_tokens:
        row = key.shape[1] * key.shape[2]
        keys, values = key.reshape(num_tokens, row), value.reshape(num_tokens, row)
        _write_kv_kernel[(num_tokens,)](
            keys, values, kv_cache, slot_mapping, keys.stride(0), values.stride(0), kv_cache.stride(0),
            ROW=row, ROW_PAD=triton.next_power_of_2(row),
        )


@triton.jit
def _paged_attention_kernel(
    out_ptr, query_ptr, cache_ptr, tables_ptr, seq_index_ptr, kv_lens_ptr, scale, window,
    query_stride_t, query_stride_h, out_stride_t, out_stride_h,
    cache_stride_kv, cache_stride_block, cache_stride_slot, cache_stride_head, table_stride, block_size,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per (query row, KV head): the GROUP query heads that share
    the KV head attend to the row's first kv_len tokens, found through the
    sequence's block table; online softmax over tiles of BLOCK_N keys. With
    window > 0, only the last `window` of them (sliding-window attention)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_index_ptr + row)
    kv_len = tl.load(kv_lens_ptr + row)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + group
    head_mask = (group < GROUP)[:, None] & (dims < HEAD_DIM)[None, :]
    query = tl.load(query_ptr + row * query_stride_t + heads[:, None] * query_stride_h + dims[None, :],
                    mask=head_mask, other=0.0).to(tl.float32)
    best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    first = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    for start in range(first, kv_len, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        token_mask = tokens < kv_len
        blocks = tl.load(tables_ptr + seq * table_stride + tokens // block_size, mask=token_mask, other=0)
        slots = (blocks.to(tl.int64) * cache_stride_block + (tokens % block_size) * cache_stride_slot
                 + kv_head * cache_stride_head)
        kv_mask = token_mask[:, None] & (dims < HEAD_DIM)[None, :]
        keys = tl.load(cache_ptr + slots[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        values = tl.load(cache_ptr + cache_stride_kv + slots[:, None] + dims[None, :], mask=kv_mask,
                         other=0.0).to(tl.float32)
        scores = tl.sum(query[:, None, :] * keys[None, :, :], axis=2) * scale  # [GROUP_PAD, BLOCK_N]
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, axis=1))
        rescale = tl.exp(best - new_best)
        weights = tl.exp(scores - new_best[:, None])
        total = total * rescale + tl.sum(weights, axis=1)
        acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
        best = new_best
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # a row with no keys gets zeros
    tl.store(out_ptr + row * out_stride_t + heads[:, None] * out_stride_h + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=head_mask)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    seq_index: torch.Tensor, kv_lens: torch.Tensor, scale: float, window: int = 0) -> torch.Tensor:
    """Each query row [T, H, D] attends to the first kv_lens[t] tokens of
    sequence seq_index[t] in kv_cache [2, num_blocks, block_size, KVH, D]
    (block_tables [num_seqs, max_blocks]): decodes, prefill chunks and chunks
    after a cached prefix alike, the causal mask being each row's kv_len (and
    with window > 0, each row's last `window` keys only)."""
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    out = torch.empty_like(query)
    if num_rows:
        group = num_heads // num_kv_heads
        _paged_attention_kernel[(num_rows, num_kv_heads)](
            out, query, kv_cache, block_tables, seq_index, kv_lens, scale, window,
            query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), block_tables.stride(0),
            kv_cache.shape[2],
            GROUP=group, GROUP_PAD=max(triton.next_power_of_2(group), 2), HEAD_DIM=head_dim,
            DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_N=32,
        )
    return out


# ---- fused MoE ----------------------------------------------------------------------------------

MOE_BLOCK_M = 16
"""Rows of one expert's block: each expert's (token, slot) pairs are padded to a multiple of this."""


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr, weights_ptr, n, k, top_k,
    a_stride, w_stride_expert, w_stride_n, out_stride,
    ROWS_ARE_TOKENS: tl.constexpr, WEIGHTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[row] = a[row] @ w[expert]^T for the BLOCK_M padded rows of one
    expert: a's rows are the pairs' tokens (the first GEMM, reading the hidden
    states) or the padded rows themselves (the second); WEIGHTED scales each
    row by its routing weight."""
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= 0:
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + rows)
        row_mask = pairs >= 0
        if ROWS_ARE_TOKENS:
            a_rows = tl.where(row_mask, pairs // top_k, 0)
        else:
            a_rows = rows
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for start in range(0, k, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_mask = ks < k
            a = tl.load(a_ptr + a_rows[:, None].to(tl.int64) * a_stride + ks[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            w = tl.load(w_ptr + expert.to(tl.int64) * w_stride_expert + cols[None, :] * w_stride_n + ks[:, None],
                        mask=col_mask[None, :] & k_mask[:, None], other=0.0).to(tl.float32)
            acc += tl.dot(a, w)
        if WEIGHTED:
            acc *= tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)[:, None]
        tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """kernels/moe.py's fused_moe as two grouped GEMMs over the experts routed
    to (this rank's: expert_offset..), with no host sync: the pairs are
    sorted and padded per expert on the device."""
    num_tokens, hidden_size = hidden.shape
    num_local, intermediate = w13.shape[0], w2.shape[2]
    pairs, block_experts = _align_pairs(topk_ids.reshape(-1) - expert_offset, num_local)
    rows, top_k = pairs.shape[0], topk_ids.shape[1]
    # Padding rows stay zero through the activation; the second GEMM skips them.
    gate_up = torch.zeros(rows, 2 * intermediate, dtype=hidden.dtype, device=hidden.device)
    _moe_gemm(hidden, w13, gate_up, pairs, block_experts, topk_weights, top_k, rows_are_tokens=True)
    activated = silu_and_mul(gate_up)
    down = torch.empty(rows, hidden_size, dtype=torch.float32, device=hidden.device)
    _moe_gemm(activated, w2, down, pairs, block_experts, topk_weights, top_k, rows_are_tokens=False)
    # Each row back to its token; padded rows go to a spare row past the end.
    tokens = torch.where(pairs >= 0, pairs // top_k, num_tokens)
    out = torch.zeros(num_tokens + 1, hidden_size, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, tokens, down)
    return out[:num_tokens].to(hidden.dtype)


def _moe_gemm(a, w, out, pairs, block_experts, topk_weights, top_k: int, rows_are_tokens: bool) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n, block_k = 32, 32
    _moe_gemm_kernel[(block_experts.shape[0], triton.cdiv(n, block_n))](
        a, w, out, pairs, block_experts, topk_weights.reshape(-1).float(), n, k, top_k,
        a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        ROWS_ARE_TOKENS=rows_are_tokens, WEIGHTED=not rows_are_tokens,
        BLOCK_M=MOE_BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def _align_pairs(local_ids: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs routed to local experts, sorted by expert and
    padded to MOE_BLOCK_M rows per expert: (pair index per row, -1 for
    padding; expert per block of rows, -1 for blocks past the last). Sized
    for the worst case, so that no count has to come back to the host."""
    num_pairs, block = local_ids.shape[0], MOE_BLOCK_M
    is_local = (local_ids >= 0) & (local_ids < num_local)
    experts = torch.where(is_local, local_ids, num_local)  # pairs of other ranks sort last
    order = torch.argsort(experts, stable=True)
    counts = torch.bincount(experts, minlength=num_local + 1)[:num_local]
    padded = (counts + block - 1) // block * block
    padded_ends = torch.cumsum(padded, 0)
    starts = torch.cumsum(counts, 0) - counts
    capacity = num_pairs + num_local * (block - 1)
    capacity = (capacity + block - 1) // block * block
    sorted_experts = experts[order]
    local_sorted = sorted_experts < num_local
    expert_index = sorted_experts.clamp(max=num_local - 1)
    rank = torch.arange(num_pairs, device=local_ids.device) - starts[expert_index]
    destination = torch.where(local_sorted, padded_ends[expert_index] - padded[expert_index] + rank, capacity)
    pairs = torch.full((capacity + 1,), -1, dtype=torch.int64, device=local_ids.device)
    pairs.scatter_(0, destination, order)
    block_starts = torch.arange(0, capacity, block, device=local_ids.device)
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_local, block_experts, -1).to(torch.int32)
    return pairs[:capacity], block_experts


# ---- GGUF blocks ----------------------------------------------------------------------------------

@triton.jit
def _half_at(ptr, mask):
    """The float32 value of the fp16 stored little-endian at ptr (bytes); 0 where masked."""
    low = tl.load(ptr, mask=mask, other=0).to(tl.uint16)
    high = tl.load(ptr + 1, mask=mask, other=0).to(tl.uint16)
    return (low | (high << 8)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _gguf_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, m, n, k, x_stride, w_stride, out_stride,
                        GGUF_TYPE: tl.constexpr, BLOCK_BYTES: tl.constexpr, HAS_BIAS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out = x @ W^T (+ bias) for a tile of rows and output features, W read
    as the file's blocks (one row of blocks per feature) and dequantized per
    block of 32 inputs, rounded to x's dtype as loading dequantized weights did."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < m, cols < n
    inputs = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for block in range(0, k // 32):
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_stride + block * 32 + inputs[None, :],
                    mask=row_mask[:, None], other=0.0)
        start = w_ptr + cols[:, None].to(tl.int64) * w_stride + block * BLOCK_BYTES  # [BLOCK_N, 1]
        scale = _half_at(start, col_mask[:, None])  # no read past the last feature's row
        if GGUF_TYPE == 8:  # Q8_0: 32 int8
            q = tl.load(start + 2 + inputs[None, :], mask=col_mask[:, None], other=0)
            w = q.to(tl.int8, bitcast=True).to(tl.float32) * scale
        else:  # Q4_0, Q4_1: byte j holds input j (low nibble) and j + 16 (high)
            values = start + (4 if GGUF_TYPE == 3 else 2)
            byte = tl.load(values + (inputs % 16)[None, :], mask=col_mask[:, None], other=0)
            q = ((byte >> tl.where(inputs < 16, 0, 4)[None, :].to(tl.uint8)) & 0xF).to(tl.float32)
            if GGUF_TYPE == 3:
                w = q * scale + _half_at(start + 2, col_mask[:, None])
            else:
                w = (q - 8.0) * scale
        # Rounded to x's dtype, then multiplied in float32 (on a GPU TF32, which
        # holds bfloat16 values exactly; the interpreter cannot multiply bfloat16).
        w = tl.where(col_mask[:, None], w, 0.0).to(x_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.dot(x.to(tl.float32), tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * out_stride + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, gguf_type: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, N] for W kept as a GGUF file's blocks:
    uint8 [N, K / 32 * block bytes] (Q4_0, Q4_1 or Q8_0)."""
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m, block_n = 16, 32  # tl.dot's smallest tile: a decode step's rows pad to 16
    _gguf_linear_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, weight, bias if bias is not None else x, out, m, n, k, x.stride(0), weight.stride(0), out.stride(0),
        GGUF_TYPE=gguf_type, BLOCK_BYTES=KEPT_TYPES[gguf_type][1], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return out
