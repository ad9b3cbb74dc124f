"""Verifying drafts against the definition of speculative sampling: every output token has the
distribution that sampling it alone, after the tokens before it, has (temperature, penalties that
count the kept drafts); greedy keeps drafts exactly while they are the argmax."""
from __future__ import annotations

import collections

import pytest
import torch

from fleet.core.sampling_params import SamplingParams
from fleet.workers.sampler import SamplingRow
from fleet.workers.spec_decode import verify_drafts

VOCAB = 6
PROMPT, OUTPUT = [1], [5]


def row(generator: torch.Generator | None = None, **params) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), PROMPT, OUTPUT, generator, [])


def expected(logits: torch.Tensor, output: list[int], temperature: float, frequency_penalty: float) -> torch.Tensor:
    """The distribution of the next token after `output`, written out from the parameters' definitions."""
    counts = torch.bincount(torch.tensor(output), minlength=VOCAB).float()
    return torch.softmax((logits - frequency_penalty * counts) / temperature, dim=-1)


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    logits = torch.tensor([[0.0, 3, 1, 0, 0, 0], [0, 0, 4, 1, 0, 0], [5, 0, 0, 0, 0, 0], [0, 0, 0, 0, 2, 0]])
    assert verify_drafts(logits, row(temperature=0.0), [1, 2, 0]) == ([1, 2, 0, 4], None)
    assert verify_drafts(logits, row(temperature=0.0), [1, 3, 0]) == ([1, 2], None)
    assert verify_drafts(logits, row(temperature=0.0), [2, 2, 0]) == ([1], None)
    tokens, logprobs = verify_drafts(logits, row(temperature=0.0, logprobs=1), [1, 2, 4])
    assert tokens == [1, 2, 0]
    raw = torch.log_softmax(logits, dim=-1)
    assert [entry.logprobs[0] for entry in logprobs] == pytest.approx([raw[i, t].item() for i, t in enumerate(tokens)])


@pytest.mark.parametrize("temperature, frequency_penalty", [(1.0, 0.0), (0.6, 1.5)])
def test_each_output_token_has_the_distribution_of_sampling_it_alone(temperature, frequency_penalty):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, VOCAB, generator=generator)
    drafts = [int(logits[0].argmax()), int(logits[1].argmax())]  # likely, so both paths are often taken
    sampling = row(generator, temperature=temperature, frequency_penalty=frequency_penalty)
    runs = [verify_drafts(logits, sampling, drafts)[0] for _ in range(12_000)]

    def observed(position: int) -> tuple[torch.Tensor, int]:
        """The distribution of output token `position` in the runs that kept every draft before it."""
        tokens = [run[position] for run in runs if run[:position] == drafts[:position]]
        counts = collections.Counter(tokens)
        return torch.tensor([counts[t] / len(tokens) for t in range(VOCAB)]), len(tokens)

    for position in range(3):
        frequencies, num_runs = observed(position)
        assert num_runs > 1500
        truth = expected(logits[position], OUTPUT + drafts[:position], temperature, frequency_penalty)
        assert (frequencies - truth).abs().max() < 4.5 * (0.25 / num_runs) ** 0.5, (position, frequencies, truth)
    assert all(1 <= len(run) <= 3 for run in runs)


def test_a_draft_of_probability_one_is_always_kept():
    logits = torch.tensor([[0.0, 50, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]])
    generator = torch.Generator().manual_seed(1)
    for _ in range(200):
        tokens, _ = verify_drafts(logits, row(generator, temperature=1.0, top_k=1), [1])
        assert tokens[0] == 1 and len(tokens) == 2
