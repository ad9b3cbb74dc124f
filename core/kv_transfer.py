"""Prefill/decode disaggregation, the scheduler's side (no torch, no sockets).

A prefill instance runs a request with `do_remote_decode` as usual; when it
finishes, its blocks are not freed but exported (KVExports): the workers
are told which blocks they may serve to a decode instance, and the request's
last output says where they are (KVTransferParams, do_remote_prefill). The
decode instance admits the same prompt with those params as if its first
num_prompt_tokens - 1 tokens were prefix-cache hits (plan_load): it allocates
the blocks, and the step's KVLoad makes its workers pull the KV into them
before the forward, which computes only the last prompt token (that yields
the first token's logits, as a full prefix-cache hit does). A load that fails
on any worker falls back to computing the prompt here. Either way the decode
engine tells the prefill engine (KVRelease), which frees the blocks; blocks
nobody pulls are freed after hold_timeout_s.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from fleet.core.messages import KVLoad, KVTransferParams
from fleet.core.request import Request


class KVExports:
    """Finished requests whose blocks wait for a decode instance to pull them."""

    def __init__(self, free: Callable[[Request], None], block_ids: Callable[[str], list[int]], hold_timeout_s: float):
        self._free = free
        self._block_ids = block_ids
        self.hold_timeout_s = hold_timeout_s
        self._held: dict[str, tuple[Request, float]] = {}
        """Request id -> (request, when its hold expires)."""
        self._new_exports: dict[str, list[int]] = {}
        self._releases: list[str] = []

    def hold(self, request: Request, block_size: int) -> KVTransferParams:
        """Keep a finished request's blocks; the params a decode instance needs (addresses filled by the engine)."""
        num_blocks = -(-request.num_prompt_tokens // block_size)
        block_ids = self._block_ids(request.request_id)[:num_blocks]
        self._held[request.request_id] = (request, time.monotonic() + self.hold_timeout_s)
        self._new_exports[request.request_id] = block_ids
        return KVTransferParams(do_remote_prefill=True, remote_request_id=request.request_id,
                                remote_block_ids=block_ids, remote_num_tokens=request.num_prompt_tokens)

    def release(self, request_id: str) -> None:
        """The decode instance is done with it (or never will be): free its blocks; unknown ids are ignored."""
        held = self._held.pop(request_id, None)
        if held is None:
            return
        self._free(held[0])
        if self._new_exports.pop(request_id, None) is None:
            self._releases.append(request_id)  # the workers were told of it: tell them it ended

    def expire(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, (_, deadline) in self._held.items() if deadline <= now]:
            self.release(request_id)

    @property
    def num_held(self) -> int:
        return len(self._held)

    @property
    def has_changes(self) -> bool:
        return bool(self._new_exports or self._releases)

    def take_changes(self) -> tuple[dict[str, list[int]], list[str]]:
        """Exports and releases the workers have not heard of yet (for the next SchedulerOutput)."""
        exports, releases = self._new_exports, self._releases
        self._new_exports, self._releases = {}, []
        return exports, releases


def remote_prefill(request: Request) -> KVTransferParams | None:
    """The request's remote prefill params, if it has any left to use."""
    params = request.kv_transfer
    return params if params is not None and params.do_remote_prefill else None


def plan_load(request: Request, num_computed_tokens: int, block_size: int,
              block_ids: list[int]) -> KVLoad | None:
    """The KVLoad that brings the request's prompt up to num_prompt_tokens - 1
    computed tokens, or None when the remote KV gives nothing more than the
    local prefix cache (num_computed_tokens, block-aligned). `block_ids`: all
    the request's blocks once allocated."""
    params = remote_prefill(request)
    target = request.num_prompt_tokens - 1
    if params is None or target <= num_computed_tokens:
        return None
    first_block = num_computed_tokens // block_size
    end_block = -(-target // block_size)
    return KVLoad(request.request_id, block_ids[first_block:end_block], params.remote_request_id, first_block,
                  params.remote_kv_addresses)


def usable(params: KVTransferParams, num_prompt_tokens: int, block_size: int, replica_size: int) -> str | None:
    """Why a decode instance cannot load from these params (None: it can)."""
    if not params.remote_request_id or not params.remote_release_address:
        return "no remote_request_id or remote_release_address"
    if len(params.remote_kv_addresses) != replica_size:
        return (f"the prefill instance has {len(params.remote_kv_addresses)} workers per replica, "
                f"this one {replica_size}")
    needed = num_prompt_tokens - 1
    if params.remote_num_tokens < needed or len(params.remote_block_ids) * block_size < needed:
        return f"the remote KV holds {params.remote_num_tokens} tokens, the prompt has {num_prompt_tokens}"
    return None
