"""Turn engine outputs into per-request results: detokenised text, logprobs,
finish reasons, and the n sequences of one request put back together.

A request with n > 1 runs in the engine as n child requests (seed + index
each), so the engine only ever samples one sequence per request.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import msgspec

from fleet.core.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, KVTransferParams, TokenLogprobs
from fleet.core.sampling_params import SamplingParams
from fleet.frontend.detokenizer import IncrementalDetokenizer


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


SequenceLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: SequenceLogprobs | None = None
    finish_reason: str | None = None
    """OpenAI's: "stop", "length", "abort" or "error" (the engine's FinishReason, or "stop" for a stop string)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that ended it; None for eos and every other finish."""
    error: str | None = None
    """Why an error ended it."""
    cumulative_logprob: float | None = None
    """The sum of the sampled tokens' logprobs; None unless the request asked for logprobs."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """When things happened to one request (vLLM's RequestOutput.metrics). Times are time.time()."""

    arrival_time: float
    """The front end took the request."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    time_in_queue: float | None = None
    """Seconds it waited in the engine before it was first scheduled."""
    prefill_time: float | None = None
    """Seconds from its first scheduling to its first token, in the engine."""

    @property
    def first_scheduled_time(self) -> float | None:
        if self.first_token_time is None or self.prefill_time is None:
            return None
        return self.first_token_time - self.prefill_time

    @property
    def decode_time(self) -> float | None:
        """From the first token to the last."""
        if self.first_token_time is None or self.last_token_time is None:
            return None
        return self.last_token_time - self.first_token_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: SequenceLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    embedding: list[float] | None = None
    """An embedding request's vector (LLM.embed, /v1/embeddings)."""
    kv_transfer_params: dict | None = None
    """A prefill instance's answer to do_remote_decode (EngineCoreOutput.kv_transfer, as JSON)."""

    @property
    def finished(self) -> bool:
        return all(output.finished for output in self.outputs)


EMBEDDING_PARAMS = SamplingParams(max_tokens=1)
"""The params of an embedding request: it samples nothing, and max_tokens 1
makes the context check leave room for its prompt only."""


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


def child_requests(request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float,
                   client_index: int, priority: int = 0, pooling: str | None = None,
                   kv_transfer: KVTransferParams | None = None) -> list[EngineCoreRequest]:
    """The n engine requests of one user request: n = 1 each, distinct seeds, and for n > 1
    the user request's id as parent_request_id, so the scheduler counts them as one group
    (`pooling`: an embedding request, see EngineCoreRequest.pooling)."""
    children = []
    for index in range(params.n):
        seed = None if params.seed is None else params.seed + index
        child_params = SamplingParams(**{**_fields(params), "n": 1, "seed": seed})
        children.append(
            EngineCoreRequest(child_request_id(request_id, index, params.n), prompt_token_ids, child_params,
                              arrival_time, client_index, priority, pooling,
                              parent_request_id=request_id if params.n > 1 else None,
                              # one transfer per prompt: the other sequences find its blocks in the prefix cache
                              kv_transfer=kv_transfer if index == 0 else None)
        )
    return children


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__struct_fields__}


class RequestState:
    """One user request while it runs: its sequences and their detokenizers."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, tokenizer):
        self.output = RequestOutput(request_id, prompt, list(prompt_token_ids), [CompletionOutput(i) for i in range(params.n)],
                                    metrics=RequestMetrics(arrival_time=time.time()))
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizers = [IncrementalDetokenizer(tokenizer, prompt_token_ids, params) for _ in range(params.n)]
        self.done = threading.Event()

    def apply(self, index: int, engine_output: EngineCoreOutput) -> bool:
        """Fold one engine output into sequence `index`; True if a stop string
        ended it (the engine must then be told to abort it)."""
        sequence = self.output.outputs[index]
        detokenizer = self.detokenizers[index]
        new_token_ids = engine_output.new_token_ids
        shown = new_token_ids
        if engine_output.finish_reason == FinishReason.STOP and not self.params.include_stop_str_in_output:
            shown = shown[:-1]  # the eos or stop token that ended it (FinishReason.STOP) is not part of the text
        num_decoded = len(detokenizer.token_ids)
        stop_string = detokenizer.append(shown)
        if stop_string is not None:  # tokens after the one completing it (one step's drafts) are not output
            new_token_ids = new_token_ids[: len(detokenizer.token_ids) - num_decoded]
        sequence.token_ids.extend(new_token_ids)
        sequence.text = detokenizer.text
        if engine_output.new_logprobs is not None and self.params.logprobs is not None:
            new = [self._as_dict(lp) for lp in engine_output.new_logprobs[: len(new_token_ids)]]
            sequence.logprobs = (sequence.logprobs or []) + new
            sampled = sum(entry[token].logprob for entry, token in zip(new, new_token_ids, strict=True))
            sequence.cumulative_logprob = (sequence.cumulative_logprob or 0.0) + sampled
        self._time(engine_output)
        if engine_output.prompt_logprobs is not None and index == 0:
            # Arrive chunk by chunk; position 0 has no logprob (nothing predicts it).
            self.output.prompt_logprobs = (self.output.prompt_logprobs or [None]) + [
                self._as_dict(lp) for lp in engine_output.prompt_logprobs
            ]
        if engine_output.num_cached_tokens:
            self.output.num_cached_tokens = engine_output.num_cached_tokens
        if engine_output.embedding is not None:
            self.output.embedding = engine_output.embedding
        if engine_output.kv_transfer is not None:
            self.output.kv_transfer_params = msgspec.to_builtins(engine_output.kv_transfer)
        ended_by_stop_string = stop_string is not None and sequence.finish_reason is None
        if ended_by_stop_string:
            sequence.finish_reason, sequence.stop_reason = FinishReason.STOP.value, stop_string
        elif engine_output.finish_reason is not None and sequence.finish_reason is None:
            sequence.finish_reason = engine_output.finish_reason.value
            sequence.stop_reason, sequence.error = engine_output.stop_reason, engine_output.error
        if self.output.finished and self.output.metrics.finished_time is None:
            self.output.metrics.finished_time = time.time()
        return ended_by_stop_string

    def _time(self, engine_output: EngineCoreOutput) -> None:
        metrics, now = self.output.metrics, time.time()
        if engine_output.new_token_ids:
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                metrics.time_in_queue, metrics.prefill_time = engine_output.queue_time, engine_output.prefill_time
            metrics.last_token_time = now

    def shows_nothing(self) -> bool:
        """Whether nothing of it can have reached its client yet: no sequence
        finished, and none has stable text (streams send only that, and
        logprobs only with it; a token may be held back as an incomplete character)."""
        if self.output.prompt_logprobs is not None:  # a stream's first chunk may carry them
            return False
        return not any(sequence.finished or detokenizer.stable_text_length(False)
                       for sequence, detokenizer in zip(self.output.outputs, self.detokenizers))

    def restart(self) -> None:
        """Forget what the engine produced (it is sent again, to another replica); only while it shows nothing."""
        assert self.shows_nothing()
        for sequence in self.output.outputs:  # in place: a handler may hold them
            sequence.token_ids.clear()
            sequence.text, sequence.logprobs, sequence.cumulative_logprob = "", None, None
        self.detokenizers = [IncrementalDetokenizer(self.tokenizer, self.output.prompt_token_ids, self.params)
                             for _ in range(self.params.n)]
        self.output.prompt_logprobs, self.output.num_cached_tokens = None, 0
        self.output.metrics.first_token_time = self.output.metrics.last_token_time = None

    def fail(self, reason: str) -> None:
        for sequence in self.output.outputs:
            if sequence.finish_reason is None:
                sequence.finish_reason, sequence.error = FinishReason.ERROR.value, reason
        self.output.metrics.finished_time = self.output.metrics.finished_time or time.time()

    def _as_dict(self, logprobs: TokenLogprobs) -> dict[int, Logprob]:
        decode = (lambda t: self.tokenizer.decode([t])) if self.tokenizer is not None else (lambda t: None)
        return {
            token_id: Logprob(value, rank, decode(token_id))
            for token_id, value, rank in zip(logprobs.token_ids, logprobs.logprobs, logprobs.ranks)
        }


Tracked = TypeVar("Tracked")


class RequestTracker(Generic[Tracked]):
    """Which user request each engine request belongs to, for fleet.LLM and
    the API server's AsyncEngine alike: engine (child) request id -> (what the
    client tracks for the user request, sequence index). Thread-safe: the
    engine client's output thread routes while callers add and remove."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_engine_id: dict[str, tuple[Tracked, int]] = {}

    def __len__(self) -> int:
        return len(self._by_engine_id)

    def add(self, children: list[EngineCoreRequest], tracked: Tracked) -> None:
        with self._lock:
            for index, child in enumerate(children):
                self._by_engine_id[child.request_id] = (tracked, index)

    def remove(self, engine_request_ids: Iterable[str]) -> None:
        with self._lock:
            for request_id in engine_request_ids:
                self._by_engine_id.pop(request_id, None)

    def route(self, outputs: Iterable[EngineCoreOutput]) -> list[tuple[Tracked, int, EngineCoreOutput]]:
        """Each output with its tracked request and sequence index; outputs
        of requests no longer tracked (aborted, finished) are dropped."""
        with self._lock:
            return [
                (*self._by_engine_id[output.request_id], output)
                for output in outputs
                if output.request_id in self._by_engine_id
            ]

    def engine_ids(self, picks: Callable[[Tracked], bool]) -> list[str]:
        """The engine request ids of the tracked requests that `picks` picks."""
        with self._lock:
            return [request_id for request_id, (tracked, _) in self._by_engine_id.items() if picks(tracked)]

    def take_all(self) -> list[Tracked]:
        """Every tracked request once, and forget them all (the engines died)."""
        with self._lock:
            tracked = self._each_once()
            self._by_engine_id.clear()
        return tracked

    def all(self) -> list[Tracked]:
        """Every tracked request once."""
        with self._lock:
            return self._each_once()

    def _each_once(self) -> list[Tracked]:
        """The tracked requests, each once (a request with n > 1 has n engine ids); hold the lock."""
        return list({id(tracked): tracked for tracked, _ in self._by_engine_id.values()}.values())

