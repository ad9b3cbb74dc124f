"""SamplingParams: how one request samples, as OpenAI and vLLM define it.

The same class travels on the wire (a msgspec Struct), is built by the API
server from a request body, and is what `fleet.SamplingParams` is for
offline use. `validate()` runs before a request reaches the engine (core/validation.py).
"""
from __future__ import annotations

import json
import math
from typing import Any

import msgspec

MAX_N = 128
"""Most completions one request may ask for: each is an engine request, and on
a CPU that computes tens of tokens a second more would hold the engine for
hours (vLLM allows 16384 on GPUs)."""
MAX_STOP = 64
"""Most stop strings, and most stop_token_ids, one request may give: each is
checked at every token of every sequence (OpenAI allows 4 stop strings)."""
MAX_STOP_CHARS = 1024
"""Longest stop string: the text searched at each token is this long."""
MAX_LOGIT_BIAS = 100.0
"""logit_bias values must lie in [-100, 100] (OpenAI's and vLLM's bound)."""
INT64 = range(-(2**63), 2**63)
"""Integers travel as msgpack int64: anything outside is a 400, not an encoding error."""


class InvalidParameter(ValueError):
    """A request parameter is out of range; `param` names it (OpenAI's error `param`)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How constrained JSON is laid out (a schema's "x-guidance" may say otherwise):
one space after "," and ":", none elsewhere. Free whitespace lets a small
model pad its answer with blank lines up to max_tokens."""


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):
    """Constrain the output to a form (vLLM's `structured_outputs`): exactly one of these."""

    json: str | dict[str, Any] | None = None
    """A JSON schema (a dict, or its JSON text): the output is a JSON document it validates."""
    regex: str | None = None
    """The output matches this regular expression (Rust regex syntax), whole."""
    choice: list[str] | None = None
    """The output is one of these strings."""
    grammar: str | None = None
    """A context-free grammar, in GBNF (llama.cpp's) or Lark syntax: the output is a sentence of it."""
    json_object: bool = False
    """The output is some JSON object."""

    def check_size(self, max_choices: int) -> StructuredOutputsParams:
        """Raise InvalidParameter unless `choice` has at most `max_choices`
        strings (a grammar of 50,000 of them takes seconds to build); return self."""
        if self.choice is not None and len(self.choice) > max_choices:
            raise InvalidParameter("structured_outputs", f"choice has {len(self.choice)} strings, more than the "
                                                         f"limit of {max_choices} (--max-structured-choices)")
        return self

    def validate(self) -> StructuredOutputsParams:
        """Raise InvalidParameter("structured_outputs", why) unless exactly one
        valid constraint is given; return self. Runs llguidance in this process."""
        from llguidance import LLMatcher  # the grammar engine, in the processes that meet constraints

        error = LLMatcher.validate_grammar(self.to_llguidance())
        if error:
            raise InvalidParameter("structured_outputs", f"invalid structured output constraint: {error.strip()}")
        return self

    def to_llguidance(self) -> str:
        """The constraint as an llguidance grammar; InvalidParameter for one that cannot be read."""
        from llguidance import LLMatcher, gbnf_to_lark

        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParameter("structured_outputs", f"give exactly one of json, regex, choice, grammar and "
                                                         f"json_object, got {given or 'none'}")
        if self.json is not None or self.json_object:
            schema = {"type": "object"} if self.json_object else self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as error:
                    raise InvalidParameter("structured_outputs", f"json must be a JSON schema: {error}") from None
            if not isinstance(schema, dict):
                raise InvalidParameter("structured_outputs", "json must be a JSON schema object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            if not self.choice or not all(isinstance(option, str) and option for option in self.choice):
                raise InvalidParameter("structured_outputs", "choice must be a list of non-empty strings")
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(option) for option in self.choice))
        try:
            return LLMatcher.grammar_from_lark(gbnf_to_lark.any_to_lark(self.grammar))
        except Exception as error:  # noqa: BLE001 - the converter raises several kinds for a bad grammar
            raise InvalidParameter("structured_outputs", f"invalid grammar: {error}") from None


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    n: int = 1
    """Completions per prompt."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 or -1: off."""
    min_p: float = 0.0
    seed: int | None = None
    """Per-request seed: the same seed gives the same text whatever else is in the batch."""
    stop: list[str] = []
    """Strings that end the output; they are left out of the text."""
    stop_token_ids: list[int] = []
    max_tokens: int | None = 16
    """None: up to the model's context length."""
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    """Top log-probabilities to return per generated token (0: only the sampled token's)."""
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    """Constrain the output to a JSON schema, regex, choice or grammar."""

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self, max_logprobs: int = 20, vocab_size: int | None = None) -> SamplingParams:
        """Raise InvalidParameter naming the first bad field; return self.
        With `vocab_size`, every token id must be one of the model's: an id
        outside it would index past the logits in a worker. The structured
        output constraint is checked apart: its grammar is native code that
        the API server runs only in its sandbox (frontend/sandbox.py)."""
        self._validate_integers()
        checks = [
            ("n", 1 <= self.n <= MAX_N, f"n must be in [1, {MAX_N}], got {self.n}"),
            ("temperature", 0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            ("top_k", self.top_k >= -1, f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}"),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            ("min_tokens", self.min_tokens >= 0, f"min_tokens must be at least 0, got {self.min_tokens}"),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= max_logprobs,
                f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= max_logprobs,
                f"prompt_logprobs must be in [0, {max_logprobs}], got {self.prompt_logprobs}",
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty"),
            ("stop", len(self.stop) <= MAX_STOP, f"at most {MAX_STOP} stop strings, got {len(self.stop)}"),
            ("stop", all(len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"stop strings must be at most {MAX_STOP_CHARS} characters"),
            ("stop_token_ids", all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP,
             f"at most {MAX_STOP} stop_token_ids, got {len(self.stop_token_ids)}"),
        ]
        for param, ok, message in checks:
            if not ok:
                raise InvalidParameter(param, message)
        self._validate_logit_bias(vocab_size)
        if vocab_size is not None:
            outside = [t for t in self.stop_token_ids if t >= vocab_size]
            if outside:
                message = f"stop_token_ids must be in [0, {vocab_size}), got {outside[0]}"
                raise InvalidParameter("stop_token_ids", message)
        return self

    def _validate_integers(self) -> None:
        fields = {"n": self.n, "top_k": self.top_k, "seed": self.seed, "max_tokens": self.max_tokens,
                  "min_tokens": self.min_tokens, "logprobs": self.logprobs, "prompt_logprobs": self.prompt_logprobs}
        for param, value in [*fields.items(), *(("stop_token_ids", t) for t in self.stop_token_ids)]:
            if value is not None and value not in INT64:
                raise InvalidParameter(param, f"{param} must be a 64-bit integer, got {value}")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            if not (0 <= token_id < (vocab_size if vocab_size is not None else 2**63)):
                bound = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
                raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids in {bound}, got {token_id}")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidParameter(
                    "logit_bias", f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {bias}"
                )
