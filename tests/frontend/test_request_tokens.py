"""--max-request-tokens' count (frontend/request_tokens.py): over all of a
request's prompts, n x (prompt tokens + max_tokens + logprob entries)."""
from __future__ import annotations

import pytest

from fleet.core.sampling_params import InvalidParameter, SamplingParams
from fleet.frontend.request_tokens import RequestTokens, fitting_max_tokens, logprob_entries

LIMIT = 128 * 2**10


def test_the_count_of_a_prompt():
    counted = RequestTokens(LIMIT, "prompt")
    counted.add(100, SamplingParams(n=3, max_tokens=10, logprobs=2, prompt_logprobs=5))
    assert (counted.prompt, counted.generated, counted.logprobs) == (300, 30, 3 * (100 * 6 + 10 * 3))
    assert logprob_entries(100, 10, None, None) == 0


def test_many_prompts_each_within_the_limit_are_refused_together():
    """The issue's 2,048 prompts x n 64 x max_tokens 2,000: one prompt fits, two do not."""
    counted = RequestTokens(LIMIT, "prompt")
    params = SamplingParams(n=64, max_tokens=2000)
    counted.add(2, params)
    with pytest.raises(InvalidParameter) as refused:
        counted.add(2, params)
    assert refused.value.param == "max_tokens"
    message = str(refused.value)
    assert "--max-request-tokens" in message and str(2 * 64 * 2002) in message and str(LIMIT) in message


def test_echo_with_logprobs_counts_each_prompt_token_per_entry():
    counted = RequestTokens(LIMIT, "prompt")
    params = SamplingParams(max_tokens=1, logprobs=20, prompt_logprobs=20)
    with pytest.raises(InvalidParameter) as refused:
        for _ in range(64):
            counted.add(400, params)
    assert refused.value.param == "logprobs" and counted.prompts == 15


def test_ordinary_requests_fit():
    counted = RequestTokens(LIMIT, "messages")
    counted.add(4000, SamplingParams(n=4, max_tokens=4000, logprobs=5))
    assert counted.total <= LIMIT


@pytest.mark.parametrize("prompt, n, logprobs, prompt_logprobs", [
    (1000, 1, None, None), (1000, 4, 20, None), (500, 2, 3, 20), (800, 128, None, None)])
def test_the_default_max_tokens_fits_exactly(prompt, n, logprobs, prompt_logprobs):
    most = fitting_max_tokens(LIMIT, prompt, n, logprobs, prompt_logprobs)
    RequestTokens(LIMIT, "messages").add(prompt, SamplingParams(n=n, max_tokens=most, logprobs=logprobs,
                                                                prompt_logprobs=prompt_logprobs))
    with pytest.raises(InvalidParameter):
        RequestTokens(LIMIT, "messages").add(prompt, SamplingParams(n=n, max_tokens=most + 1, logprobs=logprobs,
                                                                    prompt_logprobs=prompt_logprobs))
