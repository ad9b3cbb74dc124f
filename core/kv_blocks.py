"""The KV cache's block arithmetic, decided here once for the memory plan
(core/launch/memory.py), the worker that allocates the cache (workers/) and the
scheduler that hands blocks out (core/scheduler.py)."""
from __future__ import annotations


def blocks_per_sequence(max_model_len: int, block_size: int) -> int:
    """Blocks that one sequence of the full context length takes."""
    return -(-max_model_len // block_size)


def holds_a_full_sequence(num_blocks: int, max_model_len: int, block_size: int) -> bool:
    """Whether a request may grow to the context length: with fewer blocks it
    would preempt itself and never run again."""
    return num_blocks >= blocks_per_sequence(max_model_len, block_size)


def kv_bytes_per_block(block_size: int, num_kv_heads: int, head_dim: int, num_layers: int, dtype_bytes: int) -> int:
    """Bytes of one block of keys and values over a worker's layers (its KV heads only)."""
    return 2 * block_size * num_kv_heads * head_dim * num_layers * dtype_bytes
