"""Speculative decoding: which draft tokens the engine proposes and the workers
verify (--speculative-config, spelt as vLLM spells it)."""
from __future__ import annotations

from dataclasses import dataclass

SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16
"""More drafts per step than this only multiply the work of a rejected guess."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (--speculative-config): each decode step also computes up to num_speculative_tokens draft tokens, keeping those the model agrees with (exact: greedy output is unchanged, sampled output keeps its distribution)."""

    method: str = "ngram"
    """How drafts are proposed: ngram (prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens, in its prompt or output)."""
    num_speculative_tokens: int | None = None
    """Draft tokens proposed per step (required, 1 to 16)."""
    prompt_lookup_max: int | None = None
    """ngram: the longest suffix looked up (tried first). Unset: prompt_lookup_min, or 5."""
    prompt_lookup_min: int | None = None
    """ngram: the shortest suffix looked up. Unset: prompt_lookup_max, or 5."""
    model: str | None = None
    """A draft model (vLLM's key): not built in fleet, whose drafts come from the context (method ngram)."""

    def resolve(self) -> SpeculativeConfig:
        """Checked, with the lookup lengths filled in as vLLM fills them. ValueError naming the flag."""
        flag = "--speculative-config"
        if self.model is not None and self.model != "[ngram]":
            raise ValueError(f"{flag}: draft models are not built (model {self.model!r}); "
                             f"use method ngram, which drafts from the prompt and output")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"{flag}: method {self.method!r} is not built: choose from {list(SPECULATIVE_METHODS)}")
        k = self.num_speculative_tokens
        if k is None or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"{flag}: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], got {k}")
        given = [n for n in (self.prompt_lookup_min, self.prompt_lookup_max) if n is not None] or [5]
        low = self.prompt_lookup_min if self.prompt_lookup_min is not None else given[0]
        high = self.prompt_lookup_max if self.prompt_lookup_max is not None else given[0]
        if not 1 <= low <= high:
            raise ValueError(f"{flag}: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                             f"got {self.prompt_lookup_min} and {self.prompt_lookup_max}")
        return SpeculativeConfig(method=self.method, num_speculative_tokens=k, prompt_lookup_max=high,
                                 prompt_lookup_min=low)
