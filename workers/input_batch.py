"""The worker's copy of each running request, kept between steps, and the
flat batch tensors of one step gathered from it.

`CachedRequests.apply` brings the copies up to date from a SchedulerOutput
(new requests in full, then only what changed); `build_batch` gathers the
step's flat tensors. What the tensors are made of (token ids, block
tables, computed lengths) lives in `RequestRows`: one row per request in
arrays that outlive the step, so that a decode step writes its new token
and block in place and the batch is a few numpy gathers, not lists rebuilt
in Python from every request's whole history.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from fleet.core.messages import NewRequestData, SchedulerOutput
from fleet.core.sampling_params import SamplingParams
from fleet.kernels.attention import AttentionMetadata, token_positions
from fleet.workers.structured_output import GrammarState


@dataclass
class CachedRequestState:
    """A worker's copy of one request, as the SchedulerOutputs sent it (not the
    front end's RequestState, frontend/output_processor.py, which follows a
    client's request). Its token ids, blocks and computed length are in its
    row of `RequestRows`; the lists here are the sampler's (penalties, grammars)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
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


class RequestRows:
    """Per held request, one row of arrays kept between steps: its token ids
    (prompt, outputs, and this step's drafts past them), its block table
    (zeros past its blocks) and its computed tokens. Rows 0 .. len - 1 are
    the held requests: removing one moves the last row into its place. The
    arrays double when a row or a request outgrows them."""

    def __init__(self, num_rows: int = 8, max_tokens: int = 256, max_blocks: int = 16):
        self.request_ids: list[str] = []
        self.row_of: dict[str, int] = {}
        self.token_ids = np.zeros((num_rows, max_tokens), dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        """Known tokens of each row (prompt and outputs; drafts are not known)."""
        self.num_computed_tokens = np.zeros(num_rows, dtype=np.int64)
        self.block_table = np.zeros((num_rows, max_blocks), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.request_ids)

    def add(self, request_id: str, token_ids: list[int], block_ids: list[int], num_computed_tokens: int) -> None:
        row = len(self.request_ids)
        self._fit(row + 1, len(token_ids), len(block_ids))
        self.request_ids.append(request_id)
        self.row_of[request_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.block_table[row] = 0
        self.block_table[row, : len(block_ids)] = block_ids
        self.num_blocks[row] = len(block_ids)
        self.num_computed_tokens[row] = num_computed_tokens

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id)
        last = len(self.request_ids) - 1
        moved = self.request_ids.pop()
        if row == last:
            return
        self.request_ids[row] = moved
        self.row_of[moved] = row
        for array in (self.token_ids, self.num_tokens, self.num_computed_tokens, self.block_table, self.num_blocks):
            array[row] = array[last]

    def update(self, request_id: str, new_token_ids: list[int], new_block_ids: list[int],
               num_computed_tokens: int) -> None:
        """A cached request's step: its sampled tokens and new blocks appended in place."""
        row = self.row_of[request_id]
        num_tokens, num_blocks = int(self.num_tokens[row]), int(self.num_blocks[row])
        self._fit(len(self.request_ids), num_tokens + len(new_token_ids), num_blocks + len(new_block_ids))
        self.token_ids[row, num_tokens : num_tokens + len(new_token_ids)] = new_token_ids
        self.num_tokens[row] += len(new_token_ids)
        self.block_table[row, num_blocks : num_blocks + len(new_block_ids)] = new_block_ids
        self.num_blocks[row] += len(new_block_ids)
        self.num_computed_tokens[row] = num_computed_tokens

    def put_drafts(self, request_id: str, drafts: list[int]) -> None:
        """Drafts go past the row's known tokens: the step reads them there, and
        the tokens the model keeps come back (and overwrite them) next step."""
        row = self.row_of[request_id]
        num_tokens = int(self.num_tokens[row])
        self._fit(len(self.request_ids), num_tokens + len(drafts), 0)
        self.token_ids[row, num_tokens : num_tokens + len(drafts)] = drafts

    def _fit(self, num_rows: int, num_tokens: int, num_blocks: int) -> None:
        rows = _doubled_to(self.token_ids.shape[0], num_rows)
        self.token_ids = _grown(self.token_ids, (rows, _doubled_to(self.token_ids.shape[1], num_tokens)))
        self.block_table = _grown(self.block_table, (rows, _doubled_to(self.block_table.shape[1], num_blocks)))
        self.num_tokens = _grown(self.num_tokens, (rows,))
        self.num_computed_tokens = _grown(self.num_computed_tokens, (rows,))
        self.num_blocks = _grown(self.num_blocks, (rows,))


def _doubled_to(size: int, needed: int) -> int:
    while size < needed:
        size *= 2
    return size


def _grown(array: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    if array.shape == shape:
        return array
    grown = np.zeros(shape, dtype=array.dtype)
    grown[tuple(slice(0, n) for n in array.shape)] = array
    return grown


class CachedRequests:
    """All requests this worker holds, updated from each SchedulerOutput."""

    def __init__(self, device: torch.device, block_size: int):
        self.device = device
        self.block_size = block_size
        self.states: dict[str, CachedRequestState] = {}
        self.rows = RequestRows()

    def apply(self, scheduler_output: SchedulerOutput) -> None:
        """Finished and preempted requests are dropped (a preempted one comes
        back as a new request, with the tokens it had output)."""
        for request_id in scheduler_output.finished_request_ids:
            if self.states.pop(request_id, None) is not None:
                self.rows.remove(request_id)
        for new in scheduler_output.new_requests:
            self._add(new)
        for cached in scheduler_output.cached_requests:
            self.states[cached.request_id].output_token_ids.extend(cached.new_token_ids)
            self.rows.update(cached.request_id, cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens)

    def _add(self, new: NewRequestData) -> None:
        if new.request_id in self.states:  # sent again in full: the new copy replaces the old
            self.rows.remove(new.request_id)
        generator = None
        if new.sampling_params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
        self.states[new.request_id] = CachedRequestState(
            request_id=new.request_id,
            prompt_token_ids=list(new.prompt_token_ids),
            params=new.sampling_params,
            output_token_ids=list(new.output_token_ids),
            generator=generator,
            pooling=new.pooling,
        )
        token_ids = [*new.prompt_token_ids, *new.output_token_ids]
        self.rows.add(new.request_id, token_ids, new.block_ids, new.num_computed_tokens)

    def build_batch(self, scheduler_output: SchedulerOutput) -> StepBatch:
        """The step's flat tensors, gathered from the scheduled requests' rows in
        batch order; no tokens is the forward a replica runs only to join its
        peers' collectives."""
        scheduled = scheduler_output.num_scheduled_tokens
        drafts = [scheduler_output.spec_token_ids.get(request_id, []) for request_id in scheduled]
        for request_id, request_drafts in zip(scheduled, drafts, strict=True):
            if request_drafts:
                self.rows.put_drafts(request_id, request_drafts)
        rows = self.rows
        batch_rows = np.fromiter((rows.row_of[request_id] for request_id in scheduled), np.int64, len(scheduled))
        query_lens = np.fromiter(scheduled.values(), np.int64, len(scheduled))
        seq_lens = rows.num_computed_tokens[batch_rows] + query_lens
        positions = token_positions(query_lens, seq_lens)
        row_of_token = np.repeat(batch_rows, query_lens)
        width = int(rows.num_blocks[batch_rows].max(initial=1))
        block_tables = rows.block_table[batch_rows, :width]
        slots = rows.block_table[row_of_token, positions // self.block_size].astype(np.int64) * self.block_size
        slots += positions % self.block_size
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int32)
        np.cumsum(query_lens, out=query_start_loc[1:])
        query_lens_list = query_lens.tolist()
        num_decode_seqs = next((i for i, n in enumerate(query_lens_list) if n != 1), len(query_lens_list))
        attention = AttentionMetadata(
            slot_mapping=self._to_device(slots),
            query_start_loc=self._to_device(query_start_loc),
            seq_lens=self._to_device(seq_lens.astype(np.int32)),
            block_tables=self._to_device(block_tables),
            query_lens=query_lens_list,
            seq_lens_list=seq_lens.tolist(),
            num_decode_seqs=num_decode_seqs,
            decodes_only=num_decode_seqs == len(query_lens_list),
        )
        return StepBatch(
            input_ids=self._to_device(rows.token_ids[row_of_token, positions]),
            positions=self._to_device(positions),
            attention=attention,
            requests=[self.states[request_id] for request_id in scheduled],
            drafts=drafts,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)
