"""The per-replica index of cache-aware routing: the engine's block hashes,
longest match from the first block, bounded LRU that forgets tails first."""
from __future__ import annotations

import pytest

from fleet.core.messages import EngineCoreRequest
from fleet.core.request import Request
from fleet.core.sampling_params import SamplingParams
from fleet.frontend.prefix_index import PrefixIndex, prompt_block_hashes


@pytest.mark.parametrize("num_tokens,block_size", [(0, 16), (15, 16), (16, 16), (100, 16), (37, 4)])
def test_the_front_end_hashes_a_prompt_as_the_engines_prefix_cache_does(num_tokens, block_size):
    prompt = [(7 * i) % 50_000 for i in range(num_tokens)]
    engine = Request(EngineCoreRequest("r", prompt or [1], SamplingParams(), 0.0), eos_token_ids=(), max_model_len=4096,
                     block_size=block_size)
    expected = engine.block_hashes if prompt else []
    assert prompt_block_hashes(prompt, block_size) == expected
    assert len(expected) == num_tokens // block_size
    assert prompt_block_hashes(prompt, block_size, limit=2) == expected[:2]


def test_a_match_is_the_prefix_held_from_the_first_block_on():
    index = PrefixIndex(capacity=100)
    a = prompt_block_hashes(list(range(64)), 16)  # four blocks
    index.add(a[:3])
    assert index.match(a) == 3
    b = prompt_block_hashes([999] + list(range(1, 64)), 16)  # differs in the first block: every hash differs
    assert index.match(b) == 0
    assert index.match([a[0], b[1], a[2]]) == 1, "a held block after a miss does not count"
    assert index.match([]) == 0


def test_over_capacity_the_least_recently_sent_go_tail_first():
    index = PrefixIndex(capacity=5)
    a = prompt_block_hashes(list(range(48)), 16)  # three blocks
    b = prompt_block_hashes(list(range(100, 148)), 16)
    index.add(a)
    index.add(b[:2])  # five
    index.add(b)  # b's third block: a's tail goes
    assert (index.match(a), index.match(b), len(index)) == (2, 3, 5)
    index.add(a[:1])  # touched again: now a's first block is newer than all of b
    index.add(prompt_block_hashes(list(range(200, 248)), 16))  # three new ones push out a[1], b[2] and b[1]
    assert index.match(a) == 1
    assert index.match(b) == 1 and b[0] in index and b[1] not in index


def test_a_prompt_sent_again_is_not_held_twice_and_clear_forgets_all():
    index = PrefixIndex(capacity=10)
    a = prompt_block_hashes(list(range(64)), 16)
    index.add(a)
    index.add(a)
    assert len(index) == 4
    index.clear()
    assert len(index) == 0 and index.match(a) == 0


def test_an_index_holds_at_least_one_block():
    with pytest.raises(ValueError, match="capacity=0"):
        PrefixIndex(0)
