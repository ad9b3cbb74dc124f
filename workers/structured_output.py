"""Structured outputs on the driver worker: a constrained request's grammar
(llguidance) follows the request's output tokens and, before each sampling,
says which tokens may come next; the sampler masks the others.

The grammar state lives with the worker's copy of the request
(CachedRequestState) and is brought up to date from its output tokens
before each mask. A request that comes back after a preemption is a new
copy whose matcher replays the tokens it already has, so the grammar always
matches what the scheduler holds. Only the driver (tensor rank 0 of the last
pipeline stage) samples, so tensor, pipeline and data parallelism need
nothing more, and each of n > 1 completions is a request of its own.
"""
from __future__ import annotations

import numpy as np
import torch

from fleet.config.model import ModelConfig
from fleet.core.sampling_params import StructuredOutputsParams


class GrammarError(RuntimeError):
    """The request's output left its grammar, or the grammar cannot be used: the request fails."""


class Grammars:
    """The model's tokenizer as llguidance needs it, built on the first
    constrained request (about a second for a 49k-token vocabulary)."""

    def __init__(self, model: ModelConfig, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size
        """Columns of the logits: may exceed the tokenizer's vocabulary (padding rows)."""
        self._tokenizer = None

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self, params)

    def tokenizer(self):
        if self._tokenizer is None:
            from llguidance.hf import from_tokenizer

            from fleet.workers.tokenizer import load_tokenizer

            hf_tokenizer = load_tokenizer(self.model)
            if hf_tokenizer is None:
                raise GrammarError("structured outputs need the model's tokenizer, and this model ships none")
            eos = list(self.model.eos_token_ids) or None
            n_vocab = max(self.vocab_size, len(hf_tokenizer))
            self._tokenizer = from_tokenizer(hf_tokenizer, n_vocab=n_vocab, eos_token=eos)
        return self._tokenizer


class GrammarState:
    """One request's matcher, created at its first mask (not in the step
    that brought the request: a failure then fails this request only)."""

    def __init__(self, grammars: Grammars, params: StructuredOutputsParams):
        self.grammars = grammars
        self.params = params
        self.matcher = None
        self.num_consumed = 0
        """Output tokens the matcher has followed."""

    def fill_mask(self, output_token_ids: list[int], words: np.ndarray) -> None:
        """Write into `words` (int32, one bit per token) the tokens the grammar allows after `output_token_ids`."""
        from llguidance import LLMatcher

        if self.matcher is None:
            self.matcher = LLMatcher(self.grammars.tokenizer(), self.params.to_llguidance(), log_level=0)
        for token in output_token_ids[self.num_consumed :]:
            if self.matcher.is_stopped():
                # The grammar is complete: its mask allows only EOS, and with ignore_eos
                # EOS follows EOS until max_tokens. The matcher takes nothing after its end.
                break
            self.matcher.consume_token(token)
        self.num_consumed = len(output_token_ids)
        if not self.matcher.is_error():
            self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        if self.matcher.is_error():
            raise GrammarError(f"the output left its grammar: {self.matcher.get_error().splitlines()[0]}")


def allowed_tokens(rows: list[tuple[GrammarState, list[int]]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab_size] bool: for each (grammar, output tokens), the tokens it allows next."""
    words = np.zeros((len(rows), (vocab_size + 31) // 32), dtype=np.int32)
    for (grammar, output_token_ids), row_words in zip(rows, words, strict=True):
        grammar.fill_mask(output_token_ids, row_words)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits.view(np.bool_)).to(device)
