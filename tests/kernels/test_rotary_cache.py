"""The fused rotary + KV-cache write (csrc/rotary_cache_cpu.cpp) against the
torch-native rotary (kernels/rotary.py) and write_kv_cache: bit-exact, since
it rounds each product and sum as torch does."""
from __future__ import annotations

import pytest
import torch

from fleet.kernels.attention import rotate_and_cache, write_kv_cache
from fleet.kernels.rotary import RotaryEmbedding

HF_CONFIG = {"rope_theta": 10000.0}

pytestmark = pytest.mark.usefixtures("ops")  # skips where the CPU kernels cannot be built


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,head_dim", [(1, 4, 2, 64), (37, 9, 3, 64), (5, 2, 2, 128), (3, 8, 1, 32)]
)
def test_matches_the_torch_ops_bit_for_bit(dtype, tokens, heads, kv_heads, head_dim):
    generator = torch.Generator().manual_seed(tokens)
    rotary = RotaryEmbedding(head_dim, 4096, HF_CONFIG, dtype, "cpu")
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator) * 3).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=generator)
    block_size, num_blocks = 16, 64
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:tokens]
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    expected_cache = cache.clone()

    q, k, v = qkv.clone().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q, expected_k = rotary(
        positions, q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    )
    write_kv_cache(expected_k, v.reshape(tokens, kv_heads, head_dim), expected_cache, slots)

    got_q = rotate_and_cache(qkv, positions, rotary.cos_sin_cache, cache, slots, heads, kv_heads)
    assert got_q is not None and got_q.shape == (tokens, heads, head_dim)
    assert torch.equal(got_q, expected_q)
    assert torch.equal(cache, expected_cache)


def test_positions_and_slots_outside_their_tables_are_refused():
    rotary = RotaryEmbedding(64, 128, HF_CONFIG, torch.float32, "cpu")
    cache = torch.zeros(2, 4, 16, 1, 64)
    with pytest.raises(RuntimeError, match="position 128"):
        rotate_and_cache(torch.randn(1, 192), torch.tensor([128]), rotary.cos_sin_cache, cache, torch.tensor([0]), 1, 1)
    with pytest.raises(RuntimeError, match="slot 64"):
        rotate_and_cache(torch.randn(1, 192), torch.tensor([0]), rotary.cos_sin_cache, cache, torch.tensor([64]), 1, 1)
