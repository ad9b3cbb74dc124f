"""One step's token budget, and the SchedulerOutput built from it (what the
workers run): new requests in full, then only what changed."""
from __future__ import annotations

from dataclasses import dataclass, field

from fleet.core.messages import CachedRequestData, KVLoad, NewRequestData, SchedulerOutput
from fleet.core.request import Request


@dataclass
class StepBudget:
    """What one schedule() call has handed out so far."""

    token_budget: int
    requests: list[Request] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)

    def add(self, request: Request, num_tokens: int, new_block_ids: list[int], drafts: list[int] | None = None) -> None:
        """`num_tokens` counts the `drafts` (speculative decoding) computed after the request's tokens."""
        self.requests.append(request)
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.new_block_ids[request.request_id] = new_block_ids
        self.token_budget -= num_tokens
        if drafts:
            self.spec_token_ids[request.request_id] = drafts


class SchedulerOutputBuilder:
    """Builds each SchedulerOutput, sending each request in full once and then only its changes.

    Remembers how many tokens of each request the workers hold; forgetting a
    request queues its id in the next output's finished_request_ids.
    """

    def __init__(self) -> None:
        self._num_tokens_sent: dict[str, int] = {}
        self._finished_ids: list[str] = []

    @property
    def has_finished(self) -> bool:
        return bool(self._finished_ids)

    def forget(self, request_id: str) -> None:
        if self._num_tokens_sent.pop(request_id, None) is not None:
            self._finished_ids.append(request_id)

    def build(self, step_id: int, step: StepBudget) -> SchedulerOutput:
        new_requests, cached_requests = [], []
        for request in step.requests:
            request_id = request.request_id
            num_sent = self._num_tokens_sent.get(request_id)
            if num_sent is None:
                # Admitted this step: its new blocks are all its blocks.
                new_requests.append(NewRequestData(
                    request_id=request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=step.new_block_ids[request_id],
                    num_computed_tokens=request.num_computed_tokens,
                    output_token_ids=list(request.output_token_ids),
                    pooling=request.pooling,
                ))
            else:
                cached_requests.append(CachedRequestData(
                    request_id=request_id,
                    new_token_ids=request.all_token_ids[num_sent:],
                    new_block_ids=step.new_block_ids[request_id],
                    num_computed_tokens=request.num_computed_tokens,
                ))
            self._num_tokens_sent[request_id] = request.num_tokens
        finished_ids, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            step_id=step_id,
            new_requests=new_requests,
            cached_requests=cached_requests,
            num_scheduled_tokens=_decodes_first(step),
            finished_request_ids=finished_ids,
            kv_loads=step.kv_loads,
            spec_token_ids=step.spec_token_ids,
        )


def _decodes_first(step: StepBudget) -> dict[str, int]:
    """Batch order: one-token decodes first (the attention kernel splits the batch there), then the rest."""

    def is_decode(request: Request) -> bool:
        num_tokens = step.num_scheduled_tokens[request.request_id]
        return num_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens

    ordered = sorted(step.requests, key=lambda request: not is_decode(request))
    return {request.request_id: step.num_scheduled_tokens[request.request_id] for request in ordered}
