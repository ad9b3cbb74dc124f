"""Incremental detokenisation with stop strings, one instance per sequence.

Text is produced only once it is stable: a token that ends inside a
multi-byte UTF-8 character decodes to U+FFFD, so it waits for the next one.
Stop strings are searched across token boundaries and left out of the text
(unless the request includes them).
"""
from __future__ import annotations

from fleet.core.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PREFIX_WINDOW = 5
"""Tokens decoded before the new ones, so that word-joining spaces come out right."""


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - PREFIX_WINDOW, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stop_string: str | None = None
        self._max_stop_len = max((len(s) for s in params.stop), default=0)

    def append(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string if one appeared (text is cut there)."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            delta = self._decode_new()
            if not delta:
                continue
            self.text += delta
            if self._max_stop_len and self._cut_at_stop_string(len(delta)):
                return self.stop_string
        return None

    def stable_text_length(self, finished: bool) -> int:
        """How much of the text a stream may show: while running, hold back a
        tail that could still become a stop string."""
        if finished or not self._max_stop_len:
            return len(self.text)
        return max(len(self.text) - (self._max_stop_len - 1), 0)

    def _decode_new(self) -> str:
        if self.tokenizer is None:
            return ""
        skip = self.params.skip_special_tokens
        prefix = self.tokenizer.decode(self.token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=skip)
        full = self.tokenizer.decode(self.token_ids[self.prefix_offset :], skip_special_tokens=skip)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return full[len(prefix) :]

    def _cut_at_stop_string(self, delta_len: int) -> bool:
        search_from = max(len(self.text) - delta_len - self._max_stop_len + 1, 0)
        found = [(self.text.find(s, search_from), s) for s in self.params.stop]
        found = [(index, s) for index, s in found if index >= 0]
        if not found:
            return False
        index, stop = min(found)
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.text = self.text[:end]
        self.stop_string = stop
        return True
