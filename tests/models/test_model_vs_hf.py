"""Our Llama/Qwen2 over a paged KV cache vs transformers' full forward (float32).

A few lines of scheduler stand-in (`run_step`) drive the model the way the
runner will: decodes first, then prefills or prefill chunks, flattened.
"""
from __future__ import annotations

import random

import pytest

from fleet.tests.models.paged_pair import BlockPool, Pair, assert_matches_hf, load_pair, random_tokens, run_step


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_phi3_dir",
                                                 "tiny_mistral_swa_dir", "tiny_qwen3_swa_dir", "tiny_gemma3_dir",
                                                 "tiny_gemma3_multimodal_dir"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return load_pair(request.getfixturevalue(request.param))


def test_batched_prefill_then_batched_decode(pair: Pair) -> None:
    rng, pool = random.Random(1), BlockPool()
    num_decode_steps = 8
    seqs = [pool.new_seq(random_tokens(rng, n), n + num_decode_steps + 1) for n in (7, 1, 13, 30, 4)]
    run_step(pair, [(seq, len(seq.tokens)) for seq in seqs])
    for _ in range(num_decode_steps):
        run_step(pair, [(seq, 1) for seq in seqs])
    assert all(seq.num_computed == len(seq.tokens) - 1 for seq in seqs)
    assert_matches_hf(pair, seqs)


def test_decodes_alongside_chunked_prefill_and_prefix_hit(pair: Pair) -> None:
    rng, pool = random.Random(2), BlockPool()
    a = pool.new_seq(random_tokens(rng, 9), 20)
    b = pool.new_seq(random_tokens(rng, 22), 30)
    run_step(pair, [(a, 9), (b, 6)])  # a: whole prompt; b: first chunk
    run_step(pair, [(a, 1), (b, 7)])  # b's context (6) ends mid-block
    # c shares b's first two full blocks (8 tokens): a prefix-cache hit.
    c = pool.new_seq(b.tokens[:8] + random_tokens(rng, 6), 20, shared=b.block_ids[:2])
    c.num_computed = 8
    run_step(pair, [(a, 1), (b, 9), (c, 6)])
    for _ in range(5):
        run_step(pair, [(a, 1), (b, 1), (c, 1)])
    run_step(pair, [(c, 1), (a, 1)])  # a smaller batch, another order
    assert min(c.logits) == 8
    assert_matches_hf(pair, [a, b, c])


def test_prompt_fed_one_token_at_a_time(pair: Pair) -> None:
    """After a 2-token first chunk, each step feeds one token: decodes over cached context."""
    rng, pool = random.Random(3), BlockPool()
    seq = pool.new_seq(random_tokens(rng, 6), 10)
    run_step(pair, [(seq, 2)])
    for _ in range(5):
        run_step(pair, [(seq, 1)])
    assert_matches_hf(pair, [seq])
