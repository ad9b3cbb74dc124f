"""Every message on every socket: one msgspec Struct per kind, one tagged union
per socket. `core/serial.py` encodes them; nothing here imports torch.

Sockets and what travels on them:
  API server -> engine core   EngineInput   = EngineCoreRequest | Abort | UtilityCall | Shutdown
  engine core -> API server   EngineOutput  = EngineCoreOutputs | UtilityResult | EngineDead
  engine core -> workers      WorkerInput   = SchedulerOutput | WorkerUtilityCall | Shutdown
  driver worker -> engine     WorkerOutput  = ModelRunnerOutput | WorkerUtilityResult | WorkerDead
  child -> parent at start-up Handshake     = Ready | StartupFailed
  decode engine -> prefill engine  KVRelease;  decode worker <-> prefill worker  KVPull, KVPullReply + frames
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec

from fleet.core.sampling_params import SamplingParams


class Struct(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """Base of the wire messages: positional encoding, no GC tracking."""


# ---- API server -> engine core ------------------------------------------------


class KVTransferParams(msgspec.Struct, omit_defaults=True):
    """A request's part in prefill/decode disaggregation (a JSON object, so not
    array-like). Written only by fleet's own front end (--disaggregate) or by a
    proxy that knows the instances' secret (frontend/kv_transfer_gate.py): never
    taken from a client.

    To a prefill instance: do_remote_decode (compute the prompt, keep its KV
    for a decode instance). Back from it, on the finished request, and then to
    a decode instance: do_remote_prefill with where that KV is."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str | None = None
    """128 random bits (hex) naming the held KV: what a decode instance pulls and releases it by."""
    remote_num_tokens: int = 0
    """Prompt tokens the prefill instance computed (the decode instance's prompt must be the same)."""
    remote_kv_addresses: list[str] = []
    """Where each of its workers serves its share of the KV, by rank in the replica."""
    remote_release_address: str | None = None
    """Where its engine core hears that the KV was taken (KVRelease)."""


class EngineCoreRequest(Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    client_index: int = 0
    """Index of the API server (or LLM client) that sent it: where outputs go."""
    priority: int = 0
    """Lower runs first under the priority policy."""
    pooling: str | None = None
    """"last" or "mean": an embedding request. Its prompt is computed and its
    pooled final hidden state comes back (EngineCoreOutput.embedding); no token is sampled."""
    parent_request_id: str | None = None
    """The user request this is one of the n sequences of (n > 1); None: the request is its own.
    The scheduler shares the batch fairly between such groups (core/scheduler.py)."""
    kv_transfer: KVTransferParams | None = None
    """Prefill/decode disaggregation (core/kv_connector.py); None: an ordinary request."""


class Abort(Struct, tag=True):
    request_ids: list[str]


class UtilityCall(Struct, tag=True):
    call_id: int
    method: str
    """A name in EngineCore.UTILITY_METHODS, e.g. "health", "reset_prefix_cache", "kv_stats"."""
    args: list[Any] = []
    client_index: int = 0


class Shutdown(Struct, tag=True):
    reason: str = ""


EngineInput = EngineCoreRequest | Abort | UtilityCall | Shutdown


# ---- engine core -> API server ------------------------------------------------


class TokenLogprobs(Struct):
    """Log-probabilities at one position: the chosen token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    """Rank of each token in the full distribution (1 = most likely)."""


class FinishReason(enum.StrEnum):
    """Why the engine ended a request, by OpenAI's finish_reason names. The
    scheduler decides it (core/request.py's statuses); the front end adds
    only "stop" for a stop string, which it finds and then aborts."""

    STOP = "stop"
    """The last new token ended it: an eos, or one of stop_token_ids (EngineCoreOutput.stop_reason
    says which); or, without tokens, an embedding request's prompt was computed."""
    LENGTH = "length"
    """max_tokens outputs, or the context length, reached."""
    ABORT = "abort"
    ERROR = "error"
    """EngineCoreOutput.error says why."""


class EngineCoreOutput(Struct):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    """For prompt positions 1.. (position 0 has none), sent once the prompt is done."""
    finish_reason: FinishReason | None = None
    """None while running."""
    stop_reason: int | None = None
    """The stop token id that ended the request (vLLM's stop_reason); None for eos and every other finish."""
    error: str | None = None
    """Why an error ended the request."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache."""
    queue_time: float | None = None
    """Seconds from the engine's receipt of the request to its first scheduling; on the output with its first token."""
    prefill_time: float | None = None
    """Seconds from the first scheduling to the first token; on the output with its first token."""
    embedding: list[float] | None = None
    """An embedding request's result (it finishes with it)."""
    kv_transfer: KVTransferParams | None = None
    """On the last output of a do_remote_decode request: where a decode instance takes its prompt's KV."""


class SpecDecodeCounts(Struct):
    """Speculative decoding: requests that verified drafts, draft tokens, and those the model accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def add(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens

    def minus(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                                self.num_accepted_tokens - before.num_accepted_tokens)


class SchedulerStats(Struct):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the last stats."""
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    step_counter: int = 0
    kv_transfer_tokens: int = 0
    """Prompt tokens whose KV came from a prefill instance since the last stats."""
    kv_transfer_failures: int = 0
    """Transfers since the last stats that failed, so that the prompt was computed here."""
    spec_decode: SpecDecodeCounts = msgspec.field(default_factory=SpecDecodeCounts)
    """Speculative decoding since the last stats."""


class EngineCoreOutputs(Struct, tag=True):
    engine_index: int
    outputs: list[EngineCoreOutput]
    timestamp: float
    scheduler_stats: SchedulerStats | None = None


class UtilityResult(Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None


class EngineDead(Struct, tag=True):
    engine_index: int
    reason: str


class EngineAlive(Struct, tag=True):
    """An engine's heartbeat to every client (core.launch.engine_process.ENGINE_BEAT_S): a
    client learns that an engine on another node is gone from its silence."""

    engine_index: int


EngineOutput = EngineCoreOutputs | UtilityResult | EngineDead | EngineAlive


# ---- engine core -> workers: the scheduler output ----------------------------------


class NewRequestData(Struct):
    """A request the workers have not seen (or must rebuild after preemption)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []
    """Tokens generated before a preemption; empty for a fresh request."""
    pooling: str | None = None
    """An embedding request's pooling (EngineCoreRequest.pooling)."""


class CachedRequestData(Struct):
    """What changed for a request the workers already hold."""

    request_id: str
    new_token_ids: list[int]
    """Tokens appended since the last SchedulerOutput that named this request (sampled ones)."""
    new_block_ids: list[int]
    num_computed_tokens: int


class KVExport(Struct):
    """Prefill side: a finished request's blocks that a decode instance may pull."""

    block_ids: list[int]
    prompt_digest: bytes
    """sha256 of the prompt's token ids: a pull for another prompt is refused."""


class KVLoad(Struct):
    """Decode side: pull a prompt's KV from a prefill instance's workers into local blocks."""

    request_id: str
    block_ids: list[int]
    """Local blocks to fill, in order."""
    transfer_id: str
    remote_first_block: int
    """Index in the remote request's blocks of the one that fills block_ids[0]
    (the blocks before it were found in the local prefix cache)."""
    remote_kv_addresses: list[str]
    prompt_digest: bytes
    """sha256 of this request's prompt token ids: the prefill instance's must be the same."""
    consumer_id: str
    """This replica's random id: the first consumer to pull a transfer is the only one served it."""


class SchedulerOutput(Struct, tag=True):
    step_id: int
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    """Tokens each request computes this step; its order is the batch order."""
    finished_request_ids: list[str]
    """Requests finished or preempted since the last SchedulerOutput: workers drop their state."""
    kv_exports: dict[str, KVExport] = {}
    """Prefill side, by transfer id: finished requests whose blocks now wait for a decode instance to pull them."""
    kv_export_releases: list[str] = []
    """Prefill side: transfer ids that end (pulled, or held too long): their blocks may be reused from this step on."""
    kv_loads: list[KVLoad] = []
    """Decode side: KV pulls to start. They run beside the steps; the requests wait (WAITING_FOR_REMOTE_KVS)."""
    spec_token_ids: dict[str, list[int]] = {}
    """Speculative decoding: draft tokens of requests, computed after their last token
    (they count in num_scheduled_tokens) and kept as far as the model agrees."""

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


class WorkerUtilityCall(Struct, tag=True):
    call_id: int
    method: str
    args: list[Any] = []


WorkerInput = SchedulerOutput | WorkerUtilityCall | Shutdown


# ---- driver worker -> engine core -----------------------------------------------


class ModelRunnerOutput(Struct, tag=True):
    step_id: int
    request_ids: list[str]
    """Requests that sampled a token this step (prefill chunks that end mid-prompt do not)."""
    sampled_token_ids: list[list[int]]
    """Per request: the sampled token, or with drafts the accepted drafts and the token that followed them."""
    logprobs: list[list[TokenLogprobs] | None] | None = None
    """Aligned with request_ids and their tokens; None where the request asked for none."""
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    """Per request, the prompt positions computed this step."""
    failed: dict[str, str] = {}
    """Requests that could not sample this step, with why: they end with an error."""
    embeddings: dict[str, list[float]] = {}
    """Embedding requests whose prompt was completed this step: their pooled, L2-normalised final hidden state."""
    kv_loads_done: list[str] = []
    """Requests whose KV pull finished on every worker since the last step (their blocks hold it)."""
    kv_load_failed: dict[str, str] = {}
    """Requests whose KV pull ended since the last step and failed on some worker, with why."""


class WorkerUtilityResult(Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None


class WorkerDead(Struct, tag=True):
    rank: int
    reason: str


WorkerOutput = ModelRunnerOutput | WorkerUtilityResult | WorkerDead


# ---- engine cores <-> data-parallel coordinator -------------------------------------


class StepVote(Struct, tag=True):
    """An engine of a lock-step job is ready for step `step`; whether it has work."""

    dp_rank: int
    step: int
    has_work: bool


class EngineLoad(Struct, tag=True):
    """An engine's queue, sent when it changes."""

    dp_rank: int
    num_waiting: int
    num_running: int
    new_prompt_blocks: list[bytes] = []
    """Hashes of the full prompt blocks of the requests it took since its last EngineLoad, each prompt's in
    order; only with cache-aware routing by several API servers (frontend/load_balancer.py)."""


CoordinatorInput = StepVote | EngineLoad


class WaveWakeUp(Struct, tag=True):
    """To every engine of a lock-step job: someone voted for `step` while all
    were idle; the others vote too (and run empty steps) until the wave ends."""

    step: int


class StepDecision(Struct, tag=True):
    """To every engine: all voted for `step`; run it (some had work) or go idle."""

    step: int
    run: bool


CoordinatorBroadcast = WaveWakeUp | StepDecision


class EngineLoads(Struct, tag=True):
    """To API servers: unfinished requests of each engine, by data-parallel rank."""

    num_waiting: list[int]
    num_running: list[int]
    new_prompt_blocks: list[list[bytes]] = []
    """By data-parallel rank, the engines' EngineLoad.new_prompt_blocks since the last table (empty: none)."""


# ---- start-up handshake ---------------------------------------------------------


class KVCapacity(Struct):
    num_blocks: int
    block_size: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


class Ready(Struct, tag=True):
    """A child is up. Workers report their KV capacity; engine cores the
    job-wide capacity and the addresses they bound."""

    name: str
    pid: int
    kv_capacity: KVCapacity | None = None
    addresses: dict[str, str] = {}


class StartupFailed(Struct, tag=True):
    name: str
    pid: int
    error: str


Handshake = Ready | StartupFailed


# ---- prefill/decode disaggregation: between instances ---------------------------------


class KVRelease(Struct, tag=True):
    """Decode engine core -> prefill engine core: the KV of `transfer_id` was
    taken (or will not be): its blocks may go back to the pool."""

    transfer_id: str


class KVPull(Struct, tag=True):
    """Decode worker -> prefill worker of the same rank: send your share of the
    KV of `transfer_id`'s blocks [first_block, first_block + num_blocks)."""

    pull_id: int
    transfer_id: str
    first_block: int
    num_blocks: int
    prompt_digest: bytes
    """The consumer's prompt (KVLoad.prompt_digest): it must be the one the producer computed."""
    consumer_id: str


class KVPullReply(Struct, tag=True):
    """Followed by one frame per layer: that layer's K and V of the blocks,
    [2, num_blocks, block_size, num_kv_heads, head_dim] in `dtype`, contiguous."""

    pull_id: int
    error: str | None = None
    shape: list[int] = []
    dtype: str = ""
