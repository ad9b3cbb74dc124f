"""Request: one generation request inside the engine core, owner of its state.

Token ids, the number of tokens whose KV is computed, the status and the
prefix-cache block hashes live here and change only through this class's
methods; the scheduler and the KV cache manager read them.
"""
from __future__ import annotations

import enum
import hashlib
import time
from array import array
from collections.abc import Collection

import numpy as np

from fleet.core.messages import EngineCoreRequest, FinishReason, KVTransferParams, TokenLogprobs
from fleet.core.sampling_params import SamplingParams

BlockHash = bytes
"""sha256 of (parent block hash, token ids of one full block): collisions would
hand one request another's KV, so no 64-bit Python hash."""

ROOT_BLOCK_HASH: BlockHash = b""
"""Parent hash of a request's first block."""


def hash_block_tokens(parent_hash: BlockHash, token_ids: list[int]) -> BlockHash:
    """Hash of one full block, chained to its parent so equal hashes mean equal prefixes."""
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


class RequestStatus(enum.IntEnum):
    """Ordered so that `status > PREEMPTED` means finished."""

    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    """Its blocks are allocated and its prompt's KV is being pulled from a prefill instance (core/kv_connector.py)."""
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED


FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}
"""Finished status -> the reason its output carries."""


class Request:
    """A request as the engine core tracks it.

    Args:
        core_request: what the API server sent.
        eos_token_ids: every token that ends the model's generation (none for a model without).
        max_model_len: the context length; reaching it finishes the request ("length").
        block_size: KV block size; when given, the hashes of full blocks are kept
            in `block_hashes` as tokens arrive (prefix caching on).
    """

    def __init__(
        self,
        core_request: EngineCoreRequest,
        *,
        eos_token_ids: Collection[int],
        max_model_len: int,
        block_size: int | None = None,
    ):
        self.request_id: str = core_request.request_id
        self.group_id: str = core_request.parent_request_id or core_request.request_id
        """The user request it is one of the n sequences of (itself when n = 1): the unit of fair share."""
        self.client_index: int = core_request.client_index
        self.priority: int = core_request.priority
        self.arrival_time: float = core_request.arrival_time
        self.received_at = time.monotonic()
        """When this engine took the request (its own clock: queue times need no clock agreement)."""
        self.first_scheduled_at: float | None = None
        self.sampling_params: SamplingParams = core_request.sampling_params
        self.pooling: str | None = core_request.pooling
        self.kv_transfer: KVTransferParams | None = core_request.kv_transfer
        """Prefill/decode disaggregation (core/kv_connector.py); cleared once a remote prefill was used or given up."""
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.block_size = block_size

        self.prompt_token_ids: list[int] = list(core_request.prompt_token_ids)
        self.num_prompt_tokens: int = len(self.prompt_token_ids)
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self._token_buffer = np.empty(0, dtype=np.int64)
        """The first `_token_buffer_filled` of all_token_ids as numpy (all_token_array)."""
        self._token_buffer_filled = 0
        max_tokens = self.sampling_params.max_tokens
        self.max_tokens: int = max_tokens if max_tokens is not None else max_model_len

        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        """The stop token id that ended the request (None for eos and every other finish)."""
        self.error: str | None = None
        """Why an error ended the request."""
        self.num_computed_tokens: int = 0
        """Tokens whose KV is in the cache (computed or found in the prefix cache)."""
        self.num_cached_tokens: int = 0
        """Prompt tokens found in the prefix cache at the first admission."""
        self.num_preemptions: int = 0

        self.block_hashes: list[BlockHash] = []
        self._update_block_hashes()
        self._prompt_logprobs: list[TokenLogprobs] = []
        self._prompt_logprobs_sent = False

    # ---- read-only views -------------------------------------------------------

    @property
    def output_token_ids(self) -> list[int]:
        """Do not mutate: use append_output_token_ids."""
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then outputs. Do not mutate."""
        return self._all_token_ids

    def all_token_array(self) -> np.ndarray:
        """all_token_ids as int64 numpy (the ngram proposer's input), without
        converting the whole list every step: a view of a buffer that grows by
        doubling and takes the tokens appended since the last call. Do not mutate."""
        count, filled = len(self._all_token_ids), self._token_buffer_filled
        if len(self._token_buffer) < count:
            grown = np.empty(2 * count, dtype=np.int64)
            grown[:filled] = self._token_buffer[:filled]
            self._token_buffer = grown
        self._token_buffer[filled:count] = self._all_token_ids[filled:count]
        self._token_buffer_filled = count
        return self._token_buffer[:count]

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, num_tokens={self.num_tokens}, "
            f"num_computed_tokens={self.num_computed_tokens})"
        )

    # ---- tokens -------------------------------------------------------------------

    def append_output_token_ids(self, token_ids: int | list[int]) -> list[int]:
        """Append sampled tokens one at a time, checking the stop conditions after each.

        Returns the tokens actually appended: those after a stop are dropped.
        """
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        assert not self.is_finished, f"{self.request_id} is already {self.status.name}"
        appended: list[int] = []
        for token_id in token_ids:
            self._output_token_ids.append(token_id)
            self._all_token_ids.append(token_id)
            appended.append(token_id)
            if self._check_stop():
                break
        self._update_block_hashes()
        return appended

    def _check_stop(self) -> bool:
        """Set a finished status if the last token ends the request.

        eos and stop token ids count only once min_tokens outputs exist; a natural
        stop wins over a length limit reached by the same token. Stop strings are
        the front end's job (it detokenises, then aborts).
        """
        params = self.sampling_params
        last_token_id = self._output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last_token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if last_token_id in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last_token_id
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= self.max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _update_block_hashes(self) -> None:
        """Hash every block that became full since the last call."""
        if self.block_size is None:
            return
        size = self.block_size
        for start in range(len(self.block_hashes) * size, self.num_tokens - size + 1, size):
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_BLOCK_HASH
            self.block_hashes.append(hash_block_tokens(parent, self._all_token_ids[start : start + size]))

    def prompt_digest(self) -> bytes:
        """sha256 of the prompt's token ids: a prefill and a decode instance agree on a prompt by it."""
        return hashlib.sha256(array("q", self.prompt_token_ids).tobytes()).digest()

    # ---- lifecycle (called by the scheduler) -------------------------------------------

    def wait_for_remote_kv(self, num_cached_tokens: int) -> None:
        """Its blocks are allocated (the first `num_cached_tokens` from the local prefix cache);
        the rest of its prompt's KV is being pulled."""
        assert self.status == RequestStatus.WAITING, self
        self.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.num_cached_tokens = num_cached_tokens

    def remote_kv_arrived(self, num_tokens: int) -> None:
        """The pull filled its blocks with the KV of its first `num_tokens` tokens."""
        assert self.status == RequestStatus.WAITING_FOR_REMOTE_KVS, self
        self.num_computed_tokens = num_tokens

    def remote_kv_lost(self) -> None:
        """The pull failed: its blocks were freed; it computes its prompt here."""
        assert self.status == RequestStatus.WAITING_FOR_REMOTE_KVS, self
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.kv_transfer = None

    def start_running(self, num_computed_tokens: int) -> None:
        """Admitted from the waiting queue with `num_computed_tokens` found in the prefix cache
        (or pulled from a prefill instance)."""
        assert self.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED,
                               RequestStatus.WAITING_FOR_REMOTE_KVS), self
        if self.status == RequestStatus.WAITING:
            # Reported once: a recompute after preemption may hit its own blocks again.
            self.num_cached_tokens = num_computed_tokens
        self.num_computed_tokens = num_computed_tokens
        self.status = RequestStatus.RUNNING
        if self.first_scheduled_at is None:
            self.first_scheduled_at = time.monotonic()

    def advance(self, num_new_computed_tokens: int) -> None:
        """The workers computed the KV of `num_new_computed_tokens` more tokens."""
        self.num_computed_tokens += num_new_computed_tokens
        assert self.num_computed_tokens <= self.num_tokens, self

    def preempt(self) -> None:
        """Blocks were taken away: everything will be recomputed, prompt and outputs."""
        assert self.status == RequestStatus.RUNNING, self
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        if not self._prompt_logprobs_sent:
            # The recompute produces the prompt positions again from the start.
            self._prompt_logprobs.clear()

    def finish(self, status: RequestStatus, error: str | None = None) -> None:
        """End the request from outside the stop check (abort, error, an embedding
        computed); `error` says why an error ended it (sent as the output's error)."""
        assert status.is_finished, status
        self.status = status
        self.error = error

    # ---- prompt logprobs ---------------------------------------------------------------

    def add_prompt_logprobs(self, logprobs: list[TokenLogprobs]) -> None:
        """Prompt positions computed by one step; a recompute after they were sent is dropped."""
        if not self._prompt_logprobs_sent:
            self._prompt_logprobs.extend(logprobs)

    def take_prompt_logprobs(self) -> list[TokenLogprobs] | None:
        """All prompt logprobs, once, when the prompt is done; None otherwise."""
        wants = self.sampling_params.prompt_logprobs is not None
        if not wants or self._prompt_logprobs_sent or self.num_computed_tokens < self.num_prompt_tokens:
            return None
        self._prompt_logprobs_sent = True
        return self._prompt_logprobs
