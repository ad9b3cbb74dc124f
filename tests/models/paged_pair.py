"""Drives our models over a paged KV cache beside transformers' full forward
(float32): a few lines of scheduler stand-in (`run_step`) feed the model the
way the runner does: decodes first, then prefills or prefill chunks, flattened.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

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
    positions = torch.from_numpy(token_positions(query_lens, seq_lens))
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
