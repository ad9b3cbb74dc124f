"""The one validation of a request: the API server (frontend/serving.py) and
fleet.LLM call validate_request before a request leaves them, and the
scheduler calls check_prompt on what arrives, so that a front end's slip
cannot crash the engine. Errors are InvalidParameter (a ValueError), whose
messages the API server sends as OpenAI-style 400 bodies.

Not here: a structured output's grammar (native code: the API server checks
it in its sandbox, fleet.LLM in its own process) and the API server's own
limits on a request's cost (config/frontend.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fleet.core.sampling_params import InvalidParameter, SamplingParams

if TYPE_CHECKING:
    from fleet.config.fleet import FleetConfig


@dataclass(frozen=True)
class RequestLimits:
    """The facts of the model and the scheduler that a request must fit."""

    max_model_len: int
    max_unchunked_prompt: int | None = None
    """With chunked prefill off, the longest prompt (one step computes it whole:
    --max-num-batched-tokens); None: chunked prefill on, any prompt runs in chunks."""
    vocab_size: int | None = None
    """None: token ids are not checked against the vocabulary."""
    max_logprobs: int = 20

    @classmethod
    def of(cls, config: FleetConfig) -> RequestLimits:
        scheduler = config.scheduler
        return cls(
            max_model_len=config.model.max_model_len,
            max_unchunked_prompt=None if scheduler.enable_chunked_prefill else scheduler.max_num_batched_tokens,
            vocab_size=config.model.hf_config.get("vocab_size"),
            max_logprobs=config.model.max_logprobs,
        )


def validate_request(limits: RequestLimits, prompt_token_ids: list[int], params: SamplingParams) -> None:
    """Raise InvalidParameter unless the prompt can run and `params` are valid
    and leave the completion room in the context."""
    check_prompt(limits, prompt_token_ids)
    params.validate(limits.max_logprobs, limits.vocab_size)
    num_prompt_tokens = len(prompt_token_ids)
    if params.max_tokens is not None and num_prompt_tokens + params.max_tokens > limits.max_model_len:
        raise InvalidParameter(
            "max_tokens",
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + params.max_tokens} tokens ({num_prompt_tokens} in the prompt, {params.max_tokens} "
            "for the completion). Please reduce the length of the prompt or max_tokens.",
        )


def check_prompt(limits: RequestLimits, prompt_token_ids: list[int]) -> None:
    """Raise InvalidParameter("prompt", why) unless the engine can run the
    prompt: not empty, token ids of the vocabulary, room for one token after
    it, and one step can compute it where chunked prefill is off."""
    num_prompt_tokens = len(prompt_token_ids)
    if not num_prompt_tokens:
        raise InvalidParameter("prompt", "the prompt is empty")
    vocab_size = limits.vocab_size
    if vocab_size is not None and not (0 <= min(prompt_token_ids) and max(prompt_token_ids) < vocab_size):
        raise InvalidParameter("prompt", f"token ids must be in [0, {vocab_size})")
    if num_prompt_tokens >= limits.max_model_len:
        raise InvalidParameter(
            "prompt",
            f"This model's maximum context length is {limits.max_model_len} tokens. "
            f"However, your prompt has {num_prompt_tokens} tokens.",
        )
    if limits.max_unchunked_prompt is not None and num_prompt_tokens > limits.max_unchunked_prompt:
        raise InvalidParameter(
            "prompt",
            f"the prompt has {num_prompt_tokens} tokens, more than one step computes with chunked prefill off "
            f"({limits.max_unchunked_prompt}, --max-num-batched-tokens)",
        )
