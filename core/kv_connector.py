"""Prefill/decode disaggregation, the scheduler's side: one KVConnector that
the scheduler owns (no torch, no sockets: the engine-core process sends the
releases, core/kv_release.py; the workers move the KV, workers/kv_transfer.py).

Producer (prefill instance): a request with `do_remote_decode` runs as usual;
when it finishes, its blocks are not freed but held (KVExports) under a
transfer id of 128 random bits, and the workers are told which blocks they may
serve for it and for which prompt (KVExport). The request's last output
carries the id (KVTransferParams); the engine core adds where the KV is.

Consumer (decode instance): the same prompt with those params is admitted as
if its first num_prompt_tokens - 1 tokens were prefix-cache hits: its blocks
are allocated and a KVLoad makes its workers pull the KV into them. The pull
runs beside the steps while the request waits (WAITING_FOR_REMOTE_KVS); when
every worker is done, the request runs its last prompt token (which yields the
first token's logits, as a full prefix-cache hit does). A pull that fails on
any worker, or times out, makes the request compute its prompt here. Either
way the consumer tells the producer (KVRelease), which frees the blocks.

What a producer holds is bounded: hold_timeout_s, max_held_fraction of its
blocks (the oldest go first), and any held transfer goes when a request of its
own needs the blocks (its consumer then computes the prompt).
"""
from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict

import msgspec

from fleet.config.kv_transfer import KVTransferConfig
from fleet.core.kv_cache_manager import KVCacheManager
from fleet.core.messages import EngineCoreRequest, KVExport, KVLoad, KVTransferParams, ModelRunnerOutput
from fleet.core.request import Request

logger = logging.getLogger(__name__)

def new_transfer_id() -> str:
    return secrets.token_hex(16)


class KVExports:
    """Finished requests whose blocks wait for a decode instance to pull them, by transfer id."""

    def __init__(self, kv: KVCacheManager, hold_timeout_s: float, max_held_blocks: int):
        self._kv = kv
        self.hold_timeout_s = hold_timeout_s
        self.max_held_blocks = max_held_blocks
        self._held: OrderedDict[str, tuple[Request, float]] = OrderedDict()
        """Transfer id -> (request, when its hold expires), oldest first."""
        self._new_exports: dict[str, KVExport] = {}
        self._releases: list[str] = []
        self.num_held_blocks = 0

    def hold(self, request: Request, block_size: int) -> KVTransferParams:
        """Keep a finished request's blocks; the params a decode instance needs (addresses filled by the engine)."""
        transfer_id = new_transfer_id()
        num_blocks = -(-request.num_prompt_tokens // block_size)
        block_ids = self._kv.get_block_ids(request.request_id)[:num_blocks]
        self._held[transfer_id] = (request, time.monotonic() + self.hold_timeout_s)
        self.num_held_blocks += self._kv.num_held_blocks(request.request_id)
        self._new_exports[transfer_id] = KVExport(block_ids, request.prompt_digest())
        while self.num_held_blocks > self.max_held_blocks and len(self._held) > 1:
            self.release_oldest()
        return KVTransferParams(do_remote_prefill=True, transfer_id=transfer_id,
                                remote_num_tokens=request.num_prompt_tokens)

    def release(self, transfer_id: str) -> None:
        """The decode instance is done with it (or never will be): free its blocks; unknown ids are ignored."""
        held = self._held.pop(transfer_id, None)
        if held is None:
            return
        request = held[0]
        self.num_held_blocks -= self._kv.num_held_blocks(request.request_id)
        self._kv.free(request)
        if self._new_exports.pop(transfer_id, None) is None:
            self._releases.append(transfer_id)  # the workers were told of it: tell them it ended

    def release_oldest(self) -> bool:
        """Free the oldest held transfer (its consumer computes the prompt); False when none is held."""
        if not self._held:
            return False
        self.release(next(iter(self._held)))
        return True

    def expire(self) -> None:
        now = time.monotonic()
        for transfer_id in [t for t, (_, deadline) in self._held.items() if deadline <= now]:
            self.release(transfer_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def has_changes(self) -> bool:
        return bool(self._new_exports or self._releases)

    def take_changes(self) -> tuple[dict[str, KVExport], list[str]]:
        """Exports and releases the workers have not heard of yet (for the next SchedulerOutput)."""
        exports, releases = self._new_exports, self._releases
        self._new_exports, self._releases = {}, []
        return exports, releases


class KVConnector:
    """What the scheduler asks about KV transfer: admit a request's params, plan and settle its
    pull, hold a finished prompt, and the releases the engine core sends to producers."""

    def __init__(self, config: KVTransferConfig | None, kv: KVCacheManager, block_size: int, replica_size: int):
        self.config = config
        self.block_size = block_size
        self.replica_size = replica_size
        """Workers per replica: a producer must have as many (worker r pulls from worker r)."""
        hold_timeout_s = config.hold_timeout_s if config is not None else 120.0
        max_held_fraction = config.max_held_fraction if config is not None else 0.5
        self.exports = KVExports(kv, hold_timeout_s, int(max_held_fraction * kv.num_blocks))
        self.consumer_id = secrets.token_hex(16)
        self.loading: dict[str, Request] = {}
        """Requests whose KV is being pulled, by id (aborted ones too, until their pull ends)."""
        self._releases: list[tuple[str, str]] = []
        self.num_loaded_tokens = 0
        self.num_failures = 0

    # ---- consumer ---------------------------------------------------------------------------

    def admit(self, request: EngineCoreRequest) -> EngineCoreRequest:
        """The request with the KV-transfer params this engine can follow: a remote prefill it
        cannot load is computed here (its producer told), do_remote_decode kept only by producers."""
        params = request.kv_transfer
        if params is None:
            return request
        config = self.config
        params = msgspec.structs.replace(params, do_remote_decode=params.do_remote_decode and bool(
            config and config.is_producer))
        if params.do_remote_prefill:
            why = self._unusable(params, request)
            if why is not None:
                logger.warning("request %s computes its prompt here: %s", request.request_id, why)
                self.num_failures += 1
                self._queue_release(params)
                params = msgspec.structs.replace(params, do_remote_prefill=False)
        keep = params.do_remote_decode or params.do_remote_prefill
        return msgspec.structs.replace(request, kv_transfer=params if keep else None)

    def _unusable(self, params: KVTransferParams, request: EngineCoreRequest) -> str | None:
        """Why this engine cannot load from these params (None: it can)."""
        if not (self.config and self.config.is_consumer):
            return "this instance is no KV consumer (--kv-transfer-config kv_role)"
        if not params.transfer_id or not params.remote_release_address:
            return "no transfer_id or remote_release_address"
        if len(params.remote_kv_addresses) != self.replica_size:
            return (f"the prefill instance has {len(params.remote_kv_addresses)} workers per replica, "
                    f"this one {self.replica_size}")
        if params.remote_num_tokens != len(request.prompt_token_ids):
            return (f"the remote KV holds {params.remote_num_tokens} tokens, "
                    f"the prompt has {len(request.prompt_token_ids)}")
        if request.sampling_params.prompt_logprobs is not None or request.pooling is not None:
            return "prompt logprobs and embeddings need every prompt position computed here"
        return None

    def plan_load(self, request: Request, num_computed_tokens: int, block_ids: list[int]) -> KVLoad | None:
        """The KVLoad that brings the request's prompt up to num_prompt_tokens - 1 computed
        tokens, or None when the remote KV gives nothing more than the local prefix cache
        (num_computed_tokens, block-aligned). `block_ids`: all its blocks once allocated."""
        params = remote_prefill(request)
        target = request.num_prompt_tokens - 1
        if params is None or target <= num_computed_tokens:
            return None
        first_block = num_computed_tokens // self.block_size
        end_block = -(-target // self.block_size)
        return KVLoad(request.request_id, block_ids[first_block:end_block], params.transfer_id, first_block,
                      params.remote_kv_addresses, request.prompt_digest(), self.consumer_id)

    def start_load(self, request: Request, num_cached_tokens: int) -> None:
        request.wait_for_remote_kv(num_cached_tokens)
        self.loading[request.request_id] = request

    def finish_loads(self, runner_output: ModelRunnerOutput) -> list[tuple[Request, bool]]:
        """The pulls that ended since the last step: (request, whether its KV arrived). Each
        producer is told; a request whose KV arrived counts num_prompt_tokens - 1 computed."""
        ended = [(r, True) for r in runner_output.kv_loads_done] + [(r, False) for r in runner_output.kv_load_failed]
        finished: list[tuple[Request, bool]] = []
        for request_id, arrived in ended:
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            self.give_up(request)
            if request.is_finished:  # aborted while its pull ran: its blocks were kept until now
                finished.append((request, False))
            elif arrived:
                request.remote_kv_arrived(request.num_prompt_tokens - 1)
                self.num_loaded_tokens += request.num_computed_tokens - request.num_cached_tokens
                finished.append((request, True))
            else:
                self.num_failures += 1
                finished.append((request, False))
        return finished

    def give_up(self, request: Request) -> None:
        """The request will not (or no longer) use its remote KV: its producer may free it."""
        params = remote_prefill(request)
        if params is not None:
            self._queue_release(params)
            request.kv_transfer = None

    def _queue_release(self, params: KVTransferParams) -> None:
        if params.remote_release_address and params.transfer_id:
            self._releases.append((params.remote_release_address, params.transfer_id))

    def take_releases(self) -> list[tuple[str, str]]:
        """(release address, transfer id) of remote KV used or given up, for the engine core to send."""
        releases, self._releases = self._releases, []
        return releases

    # ---- producer ---------------------------------------------------------------------------

    def exports_kv(self, request: Request, finished_normally: bool) -> bool:
        params = request.kv_transfer
        return finished_normally and params is not None and params.do_remote_decode

    def hold(self, request: Request) -> KVTransferParams:
        return self.exports.hold(request, self.block_size)

    def release(self, transfer_id: str) -> None:
        self.exports.release(transfer_id)

    @property
    def has_changes(self) -> bool:
        """Exports or releases the workers have not heard of (releases to producers need no step:
        the engine core takes them after every step, and what queues them comes with one)."""
        return self.exports.has_changes


def remote_prefill(request: Request) -> KVTransferParams | None:
    """The request's remote prefill params, if it has any left to use."""
    params = request.kv_transfer
    return params if params is not None and params.do_remote_prefill else None
