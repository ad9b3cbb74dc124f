"""Our Llama/Qwen2 over a paged KV cache vs transformers' full forward (float32).

A few lines of scheduler stand-in (`run_step`) drive the model the way the
runner will: decodes first, then prefills or prefill chunks, flattened.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import read_hf_config
from fleet.kernels.attention import AttentionMetadata, token_positions
from fleet.workers.loader import load_model

BLOCK_SIZE = 4  # small, so sequences cross many block boundaries
NUM_BLOCKS = 128
ATOL = 1e-4


@dataclass
class Seq:
    tokens: list[int]
    block_ids: list[int]
    num_computed: int = 0
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    """Our logits at each position computed (predicting the next token)."""


class BlockPool:
    """Hands out block ids in a shuffled order, so tables are not contiguous."""

    def __init__(self) -> None:
        self.free = list(range(1, NUM_BLOCKS))  # block 0 stays unused: it is the tables' padding
        random.Random(0).shuffle(self.free)

    def new_seq(self, tokens: list[int], max_len: int, shared: list[int] = ()) -> Seq:
        needed = -(-max_len // BLOCK_SIZE) - len(shared)
        blocks, self.free = self.free[:needed], self.free[needed:]
        return Seq(tokens=list(tokens), block_ids=list(shared) + blocks)


@dataclass
class Pair:
    ours: torch.nn.Module
    hf: torch.nn.Module
    kv_caches: list[torch.Tensor]


def load_pair(model_dir: str) -> Pair:
    from transformers import AutoModelForCausalLM

    hf_config = read_hf_config(model_dir)
    model_config = ModelConfig(model=model_dir, model_path=model_dir, architecture=hf_config["architectures"][0],
                               hf_config=hf_config)
    ours = load_model(model_config, LoadConfig(), torch.float32, torch.device("cpu"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, ours.num_kv_heads, ours.head_dim)
    return Pair(ours, hf, [torch.zeros(shape) for _ in range(ours.num_layers)])


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def pair(request: pytest.FixtureRequest) -> Pair:
    return load_pair(request.getfixturevalue(request.param))


@torch.inference_mode()
def run_step(pair: Pair, plan: list[tuple[Seq, int]]) -> None:
    """One forward over `plan` [(seq, new tokens)]; greedy-append a token to
    every sequence whose known tokens are now all computed."""
    input_ids: list[int] = []
    for seq, num_new in plan:
        input_ids += seq.tokens[seq.num_computed : seq.num_computed + num_new]
    query_lens = [num_new for _, num_new in plan]
    seq_lens = [seq.num_computed + num_new for seq, num_new in plan]
    meta = AttentionMetadata.build(query_lens, seq_lens, [seq.block_ids for seq, _ in plan], BLOCK_SIZE)
    positions = token_positions(torch.tensor(query_lens), torch.tensor(seq_lens))
    hidden = pair.ours(torch.tensor(input_ids), positions, pair.kv_caches, meta)  # [T, hidden]
    logits = pair.ours.compute_logits(hidden)  # [T, vocab]
    assert logits.dtype == torch.float32 and logits.shape == (len(input_ids), pair.ours.spec.vocab_size)
    for (seq, num_new), seq_logits in zip(plan, logits.split(query_lens), strict=True):
        for offset in range(num_new):
            seq.logits[seq.num_computed + offset] = seq_logits[offset]
        seq.num_computed += num_new
        if seq.num_computed == len(seq.tokens):
            seq.tokens.append(int(seq_logits[-1].argmax()))


@torch.inference_mode()
def assert_matches_hf(pair: Pair, seqs: list[Seq]) -> None:
    for seq in seqs:
        computed = torch.tensor([seq.tokens[: seq.num_computed]])
        expected = pair.hf(computed).logits[0]  # [num_computed, vocab]
        positions = sorted(seq.logits)
        ours = torch.stack([seq.logits[p] for p in positions])
        torch.testing.assert_close(ours, expected[positions], atol=ATOL, rtol=0)


def random_tokens(rng: random.Random, length: int) -> list[int]:
    return [rng.randrange(3, 512) for _ in range(length)]


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
