"""Draft tokens by prompt lookup (speculative decoding, method ngram): where the
sequence's last n tokens occurred before, the tokens that followed them then
are a guess at what follows now. Costs no model: code being edited, a document
being summarised or quoted, and repeated tool transcripts repeat themselves."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from fleet.config.speculative import SpeculativeConfig


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.num_speculative_tokens = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, token_ids: np.ndarray | list[int], max_drafts: int) -> list[int]:
        """Up to min(num_speculative_tokens, max_drafts) tokens to follow `token_ids`; [] when no
        suffix of min_n to max_n tokens occurred earlier. The longest suffix that did wins, at its
        latest occurrence; a continuation that reaches the end goes on as the text repeated itself
        so far (period: the distance between the occurrence and the suffix)."""
        k = min(self.num_speculative_tokens, max_drafts)
        if k <= 0 or len(token_ids) <= self.min_n:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            # Windows of n tokens starting at 0 .. len - n - 1: every occurrence but the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if starts.size:
                end = int(starts[-1]) + n  # where the latest occurrence's continuation starts
                period = len(tokens) - end
                continuation = tokens[end:].tolist()
                return [continuation[i % period] for i in range(k)]
        return []
