"""The worker's copy of each running request, and the flat batch tensors of
one step built from its SchedulerOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fleet.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from fleet.core.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """A worker's copy of one request, as the SchedulerOutputs sent it (not the
    front end's RequestState, frontend/output_processor.py, which follows a
    client's request)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        prompt = self.prompt_token_ids
        if stop <= len(prompt):
            return prompt[start:stop]
        return (prompt + self.output_token_ids)[start:stop]


@dataclass
class StepBatch:
    """Flat tensors of one step (tokens of all requests, no padding) and the
    python facts the runner needs after the forward pass."""

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks] int32
    requests: list[CachedRequestState]
    query_lens: list[int]
    seq_lens_list: list[int]
    num_decode_seqs: int
    """Leading requests with a query of one token (the scheduler orders them first)."""


class CachedRequests:
    """All requests this worker holds, updated from each SchedulerOutput."""

    def __init__(self, device: torch.device, block_size: int):
        self.device = device
        self.block_size = block_size
        self.states: dict[str, CachedRequestState] = {}

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        for request_id in scheduler_output.finished_request_ids:
            self.states.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self.states[new.request_id] = self._new_state(new)
        for cached in scheduler_output.cached_requests:
            self._update(cached)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
        return CachedRequestState(
            request_id=new.request_id,
            prompt_token_ids=list(new.prompt_token_ids),
            params=new.sampling_params,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            output_token_ids=list(new.output_token_ids),
            generator=generator,
        )

    def _update(self, cached: CachedRequestData) -> None:
        state = self.states[cached.request_id]
        state.output_token_ids.extend(cached.new_token_ids)
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens

    def build_batch(self, scheduler_output: SchedulerOutput) -> StepBatch:
        if not scheduler_output.num_scheduled_tokens:
            return self._empty_batch()
        requests = [self.states[request_id] for request_id in scheduler_output.num_scheduled_tokens]
        query_lens = list(scheduler_output.num_scheduled_tokens.values())
        starts = [state.num_computed_tokens for state in requests]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        input_ids: list[int] = []
        for state, start, stop in zip(requests, starts, seq_lens):
            input_ids.extend(state.token_slice(start, stop))
        positions = np.concatenate([np.arange(start, stop, dtype=np.int64) for start, stop in zip(starts, seq_lens)])
        max_blocks = max(len(state.block_ids) for state in requests)
        block_tables = np.zeros((len(requests), max_blocks), dtype=np.int32)
        for i, state in enumerate(requests):
            block_tables[i, : len(state.block_ids)] = state.block_ids
        request_of_token = np.repeat(np.arange(len(requests)), query_lens)
        slots = block_tables[request_of_token, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        num_decode_seqs = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
        to = self._to_device
        return StepBatch(
            input_ids=to(np.asarray(input_ids, dtype=np.int64)),
            positions=to(positions),
            slot_mapping=to(slots),
            query_start_loc=to(np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)),
            seq_lens=to(np.asarray(seq_lens, dtype=np.int32)),
            block_tables=to(block_tables),
            requests=requests,
            query_lens=query_lens,
            seq_lens_list=seq_lens,
            num_decode_seqs=num_decode_seqs,
        )

    def _empty_batch(self) -> StepBatch:
        """No tokens: the forward a replica runs only to join its peers' collectives."""
        to = self._to_device
        return StepBatch(
            input_ids=to(np.zeros(0, dtype=np.int64)),
            positions=to(np.zeros(0, dtype=np.int64)),
            slot_mapping=to(np.zeros(0, dtype=np.int64)),
            query_start_loc=to(np.zeros(1, dtype=np.int32)),
            seq_lens=to(np.zeros(0, dtype=np.int32)),
            block_tables=to(np.zeros((0, 1), dtype=np.int32)),
            requests=[],
            query_lens=[],
            seq_lens_list=[],
            num_decode_seqs=0,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)
