"""The worker's copy of each running request, and the flat batch tensors of
one step built from its SchedulerOutput."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fleet.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from fleet.core.sampling_params import SamplingParams
from fleet.kernels.attention import AttentionMetadata, token_positions
from fleet.workers.structured_output import GrammarState


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
    grammar: GrammarState | None = None
    """A constrained request's grammar, on the driver (workers/structured_output.py)."""
    pooling: str | None = None
    """"last" or "mean" for an embedding request (no token is sampled)."""
    hidden_sum: torch.Tensor | None = None
    """Mean pooling: the sum of the final hidden states of the prompt positions computed so far."""

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
    attention: AttentionMetadata
    """Slots, block tables and lengths; decodes first, as the scheduler orders them."""
    requests: list[CachedRequestState]
    drafts: list[list[int]]
    """Per request, the draft tokens it computes after its own (speculative decoding), or []."""


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
            pooling=new.pooling,
        )

    def _update(self, cached: CachedRequestData) -> None:
        state = self.states[cached.request_id]
        state.output_token_ids.extend(cached.new_token_ids)
        state.block_ids.extend(cached.new_block_ids)
        state.num_computed_tokens = cached.num_computed_tokens

    def build_batch(self, scheduler_output: SchedulerOutput) -> StepBatch:
        """The step's flat tensors; no tokens is the forward a replica runs
        only to join its peers' collectives."""
        requests = [self.states[request_id] for request_id in scheduler_output.num_scheduled_tokens]
        query_lens = list(scheduler_output.num_scheduled_tokens.values())
        starts = [state.num_computed_tokens for state in requests]
        seq_lens = [start + n for start, n in zip(starts, query_lens)]
        drafts = [scheduler_output.spec_token_ids.get(state.request_id, []) for state in requests]
        input_ids: list[int] = []
        for state, start, stop, request_drafts in zip(requests, starts, seq_lens, drafts):
            input_ids.extend(state.token_slice(start, stop - len(request_drafts)))
            input_ids.extend(request_drafts)
        attention = AttentionMetadata.build(
            query_lens, seq_lens, [state.block_ids for state in requests], self.block_size, self.device
        )
        return StepBatch(
            input_ids=self._to_device(np.asarray(input_ids, dtype=np.int64)),
            positions=self._to_device(token_positions(query_lens, seq_lens)),
            attention=attention,
            requests=requests,
            drafts=drafts,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)
