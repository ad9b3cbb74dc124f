"""--max-request-tokens: one cap on what a request may cost, counted over the
whole request (all its prompts, all their sequences), not per prompt.

Each of a prompt's `n` sequences prefills the prompt, decodes up to
max_tokens and sends back its log-probabilities, so a request counts

    sum over its prompts of  n x (prompt tokens + max_tokens + logprob entries)

where logprob entries are what comes back per position asked for: the token
and its alternatives,

    prompt tokens x (prompt_logprobs + 1)   with prompt_logprobs (a completion's
                                            echo with logprobs k asks for k)
  + max_tokens    x (logprobs + 1)          with logprobs (chat: top_logprobs)

So 2,048 prompts x n 64 x max_tokens 2,000 count 262M, and an echo with
logprobs 20 counts each prompt token 22 times. Pure arithmetic on the
prompt's length and SamplingParams: the offline path can count the same way.
"""
from __future__ import annotations

from dataclasses import dataclass

from fleet.core.sampling_params import InvalidParameter, SamplingParams


def logprob_entries(num_prompt_tokens: int, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None) -> int:
    """The log-probabilities one sequence sends back: per position, the token and its alternatives."""
    prompt = 0 if prompt_logprobs is None else num_prompt_tokens * (prompt_logprobs + 1)
    generated = 0 if logprobs is None else max_tokens * (logprobs + 1)
    return prompt + generated


def fitting_max_tokens(limit: int, num_prompt_tokens: int, n: int, logprobs: int | None,
                       prompt_logprobs: int | None) -> int:
    """The largest max_tokens with which a one-prompt request counts at most `limit` (at least 1:
    a prompt that leaves no room is refused by the count, with its numbers)."""
    per_sequence = limit // max(n, 1) - num_prompt_tokens - logprob_entries(num_prompt_tokens, 0, None, prompt_logprobs)
    per_token = 1 + logprob_entries(0, 1, logprobs, None)
    return max(1, per_sequence // per_token)


@dataclass
class RequestTokens:
    """A request's count so far, by what asked for it: each part names the parameter that would cut it."""

    limit: int
    prompt_param: str
    """The request's prompt field: prompt (completions) or messages (chat)."""
    prompt: int = 0
    generated: int = 0
    logprobs: int = 0
    prompts: int = 0

    @property
    def total(self) -> int:
        return self.prompt + self.generated + self.logprobs

    def add(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Count one prompt's n sequences; raises InvalidParameter once the request is past the limit."""
        self.prompts += 1
        self.prompt += params.n * num_prompt_tokens
        self.generated += params.n * params.max_tokens
        self.logprobs += params.n * logprob_entries(num_prompt_tokens, params.max_tokens, params.logprobs,
                                                    params.prompt_logprobs)
        if self.total > self.limit:
            raise InvalidParameter(self._largest_param(), self._refusal())

    def _largest_param(self) -> str:
        parts = {self.prompt_param: self.prompt, "max_tokens": self.generated, "logprobs": self.logprobs}
        return max(parts, key=parts.__getitem__)

    def _refusal(self) -> str:
        prompts = f"its first {self.prompts} prompts" if self.prompts > 1 else "its prompt"
        return (f"the request counts {self.total} tokens, more than the limit of {self.limit} "
                f"(--max-request-tokens): n x (prompt tokens + max_tokens + logprob entries) over {prompts} "
                f"is {self.prompt} + {self.generated} + {self.logprobs}")
