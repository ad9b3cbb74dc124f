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
    """Bytes of KV cache per worker (e.g. 2G). Unset: a fraction of the free memory, see --gpu-memory-utilization."""
    gpu_memory_utilization: float = 0.9
    """Fraction of the device's memory fleet may use in all (weights, activations, KV cache). On the CPU: of the RAM available at start-up, with at most half of it for the KV cache."""
    enable_prefix_caching: bool | None = None
    """Reuse the KV cache of prompt prefixes shared between requests. Unset: on."""
