"""The paged KV cache."""
from __future__ import annotations

from dataclasses import dataclass

from fleet.config.fields import HumanInt


@dataclass(frozen=True)
class CacheConfig:
    """KV cache: block size, memory, prefix caching."""

    block_size: int = 16
    """Tokens per KV cache block."""
    kv_cache_memory_bytes: HumanInt | None = None
    """Bytes of KV cache per worker (e.g. 2G). Unset: on CUDA what --gpu-memory-utilization leaves after profiling; on the CPU the worker's share of the node's budget (`fleet plan` shows it)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the device's memory fleet may use in all (weights, activations, KV cache). On the CPU: of the node's RAM, shared by all of the launch's workers on the node, with at most 40 % of the RAM for their KV caches and none beyond what --max-num-seqs sequences of --max-model-len tokens can use."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV cache of prompt prefixes shared between requests. Unset: on."""
