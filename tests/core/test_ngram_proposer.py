"""Prompt lookup: the longest suffix that occurred before, the tokens that followed it then."""
from __future__ import annotations

import pytest

from fleet.config.speculative import SpeculativeConfig
from fleet.core.ngram_proposer import NgramProposer


def proposer(k: int = 3, low: int = 2, high: int = 4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=low,
                                           prompt_lookup_max=high).resolve())


def test_the_tokens_after_the_earlier_occurrence_of_the_suffix():
    assert proposer().propose([7, 1, 2, 3, 4, 5, 9, 1, 2], 10) == [3, 4, 5]
    assert proposer(k=5).propose([7, 1, 2, 3, 4, 5, 9, 1, 2], 10) == [3, 4, 5, 9, 1]
    assert proposer().propose([7, 1, 2, 3, 4, 5, 9, 1, 2], 2) == [3, 4]  # what the request can still use
    assert proposer().propose([7, 1, 2, 3], 0) == []


def test_nothing_without_an_earlier_occurrence_of_at_least_the_shortest_suffix():
    assert proposer().propose([1, 2, 3, 4, 5, 6], 10) == []
    assert proposer(low=2).propose([5, 1, 9, 1], 10) == []  # a one-token match is too short
    assert proposer(low=1).propose([5, 1, 9, 1], 10) == [9, 1, 9]
    assert proposer().propose([1, 2], 10) == []


def test_the_longest_suffix_wins_at_its_latest_occurrence_and_repeats_with_its_period():
    # "2 3" follows 8 at the start and 6 later; the 3-token suffix "1 2 3" occurred only before 8.
    assert proposer(k=1).propose([1, 2, 3, 8, 5, 2, 3, 6, 1, 2, 3], 10) == [8]
    # Two occurrences of "4 5": the later one (followed by 7 7 7) wins.
    assert proposer().propose([4, 5, 1, 1, 1, 4, 5, 7, 7, 7, 4, 5], 10) == [7, 7, 7]
    # The continuation reaches the end: the text goes on repeating with the period it showed.
    assert proposer().propose([3, 3, 3, 3, 3, 3], 10) == [3, 3, 3]
    assert proposer(k=5).propose([9, 1, 2, 6, 1, 2], 10) == [6, 1, 2, 6, 1]


@pytest.mark.parametrize("config, why", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({}, "num_speculative_tokens"),
    ({"num_speculative_tokens": 2, "method": "eagle"}, "method 'eagle' is not built"),
    ({"num_speculative_tokens": 2, "model": "some/draft"}, "draft models are not built"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
])
def test_a_config_that_cannot_work_is_refused_by_name(config, why):
    with pytest.raises(ValueError, match="--speculative-config") as error:
        SpeculativeConfig(**config).resolve()
    assert why in str(error.value)


def test_lookup_lengths_default_as_vllm_fills_them():
    assert SpeculativeConfig(num_speculative_tokens=2).resolve().prompt_lookup_min == 5
    resolved = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=3).resolve()
    assert (resolved.prompt_lookup_min, resolved.prompt_lookup_max) == (3, 3)
