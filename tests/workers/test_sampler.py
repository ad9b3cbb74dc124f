"""The sampler against the definitions it implements: top-k, top-p and min-p
keep the sets a full sort gives, draws follow the processed distribution,
greedy rows take the argmax and a seeded row draws the same token whatever
the rest of its batch."""
from __future__ import annotations

import math

import pytest
import torch

from fleet.core.sampling_params import SamplingParams
from fleet.workers import sampler
from fleet.workers.sampler import SamplingRow, sample


def row(generator: torch.Generator | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [1, 2], [3], generator, [])


def kept_by_definition(logits: torch.Tensor, k: int, p: float) -> set[int]:
    """Sort the whole row; keep the top k, then the fewest whose probability among them reaches p."""
    order = logits.argsort(descending=True)[:k]
    probs = torch.softmax(logits[order].double(), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs
    return set(order[before < p].tolist())


def kept(logits: torch.Tensor, rows: list[SamplingRow]) -> list[set[int]]:
    processed = sampler._truncate(logits, rows)
    return [set(torch.isfinite(line).nonzero().flatten().tolist()) for line in processed]


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat to peaked distributions
@pytest.mark.parametrize("vocab", [7, 300, 5000])
def test_top_k_and_top_p_keep_what_a_full_sort_keeps(scale, vocab, monkeypatch):
    monkeypatch.setattr(sampler, "TOP_P_CANDIDATES", 64)  # rows both within and beyond the partial sort
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(8, vocab, generator=generator) * scale
    settings = [(0, 1.0), (1, 1.0), (5, 1.0), (0, 0.9), (3, 0.5), (100, 0.95), (0, 0.999), (vocab + 5, 0.3)]
    rows = [row(temperature=1.0, top_k=k, top_p=p) for k, p in settings]
    for line, got, (k, p) in zip(logits, kept(logits, rows), settings, strict=True):
        assert got == kept_by_definition(line, k if k > 0 else vocab, p)


def test_min_p_keeps_tokens_at_least_p_times_the_most_likely():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.11, 0.05, 0.04]]))
    assert kept(logits, [row(temperature=1.0, min_p=0.2)]) == [{0, 1, 2}]


def test_draws_follow_the_distribution():
    probabilities = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = torch.log(probabilities).expand(4000, -1).contiguous()
    torch.manual_seed(0)
    tokens = torch.tensor(sample(logits, [row(temperature=1.0)] * 4000)[0])
    counts = torch.bincount(tokens, minlength=5).double()
    expected = probabilities.double() * 4000
    assert counts[4] == 0  # probability 0 is never drawn
    chi_square = float((((counts - expected) ** 2)[:4] / expected[:4]).sum())
    assert chi_square < 16.3  # p = 0.001 with 3 degrees of freedom


def test_greedy_rows_take_the_argmax_among_sampled_ones():
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(1))
    rows = [row(temperature=0.0), row(temperature=1.0)] * 3
    tokens = sample(logits, rows)[0]
    assert tokens[0::2] == logits[0::2].argmax(dim=-1).tolist()


def test_a_seeded_row_draws_the_same_whatever_its_batch():
    logits = torch.randn(5, 1000, generator=torch.Generator().manual_seed(2))

    def seeded() -> SamplingRow:
        return row(torch.Generator().manual_seed(1234), temperature=1.0, top_p=0.9)

    alone = sample(logits[2:3], [seeded()])[0][0]
    for _ in range(3):
        batch = [row(temperature=0.7)] * 2 + [seeded()] + [row(temperature=0.0), row(temperature=1.5, top_k=3)]
        assert sample(logits, batch)[0][2] == alone


def test_temperature_flattens_the_draws():
    logits = torch.tensor([[2.0, 0.0]]).expand(4000, -1).contiguous()
    torch.manual_seed(1)
    hot = sum(sample(logits, [row(temperature=100.0)] * 4000)[0]) / 4000
    cold = sum(sample(logits, [row(temperature=0.5)] * 4000)[0]) / 4000
    assert abs(hot - 0.495) < 0.04  # nearly uniform
    assert abs(cold - 1 / (1 + math.exp(4.0))) < 0.01
