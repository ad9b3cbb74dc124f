"""Factories and a fake worker for the scheduler tests (vLLM's create_scheduler/create_requests style).

The fake worker rebuilds each request from the scheduler outputs alone, the way a real
worker must, and asserts that what it rebuilt agrees with the scheduler; the
test chooses the sampled tokens.
"""
from __future__ import annotations

from collections.abc import Callable

from fleet.config.cache import CacheConfig
from fleet.config.kv_transfer import KVTransferConfig
from fleet.config.scheduler import SchedulerConfig
from fleet.config.speculative import SpeculativeConfig
from fleet.core.messages import EngineCoreOutput, EngineCoreRequest, ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from fleet.core.request import Request
from fleet.core.sampling_params import SamplingParams
from fleet.core.scheduler import Scheduler

EOS_TOKEN_ID = 2
DEFAULT_TOKEN_ID = 7
"""What the fake model samples unless told otherwise (not eos)."""

CREATED_SCHEDULERS: list[Scheduler] = []
"""Every scheduler of the current test; conftest asserts that none leaks a block."""


def create_scheduler(
    *,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 16,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    scheduling_policy: str = "fcfs",
    block_size: int = 16,
    num_blocks: int = 1000,
    max_model_len: int | None = None,
    eos_token_ids: tuple[int, ...] = (EOS_TOKEN_ID,),
    speculative: SpeculativeConfig | None = None,
    kv_transfer: KVTransferConfig | None = None,
) -> Scheduler:
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            enable_chunked_prefill=enable_chunked_prefill,
            scheduling_policy=scheduling_policy,
        ),
        CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching),
        max_model_len=max_model_len if max_model_len is not None else min(num_blocks * block_size, 4096),
        num_blocks=num_blocks,
        eos_token_ids=eos_token_ids,
        speculative=speculative,
        kv_transfer=kv_transfer,
    )
    CREATED_SCHEDULERS.append(scheduler)
    return scheduler


def create_requests(
    num_requests: int,
    num_tokens: int = 10,
    *,
    max_tokens: int | None = 16,
    prompt: list[int] | None = None,
    same_prompt: bool = False,
    priorities: list[int] | None = None,
    id_prefix: str = "req",
    **sampling_kwargs,
) -> list[EngineCoreRequest]:
    """Distinct prompts of `num_tokens` tokens (ids from 100 up, never eos) unless
    `prompt` or `same_prompt` says otherwise; arrival times in order."""
    requests = []
    for index in range(num_requests):
        if prompt is not None:
            token_ids = list(prompt)
        else:
            first = 100 if same_prompt else 100 + index * num_tokens
            token_ids = list(range(first, first + num_tokens))
        requests.append(
            EngineCoreRequest(
                request_id=f"{id_prefix}{index}",
                prompt_token_ids=token_ids,
                sampling_params=SamplingParams(max_tokens=max_tokens, **sampling_kwargs),
                arrival_time=float(index),
                priority=priorities[index] if priorities else 0,
            )
        )
    return requests


def add_requests(scheduler: Scheduler, core_requests: list[EngineCoreRequest]) -> list[Request]:
    return [scheduler.add_request(core_request) for core_request in core_requests]


Sampler = Callable[[str], int]


class FakeWorker:
    """Holds what a worker holds (tokens, block ids, computed count per request), fed only by scheduler outputs."""

    def __init__(self, scheduler: Scheduler, sample: Sampler | dict[str, list[int]] | None = None):
        self.scheduler = scheduler
        self.tokens: dict[str, list[int]] = {}
        self.block_ids: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}
        self.params: dict[str, SamplingParams] = {}
        self.sample = sample

    def _sample(self, request_id: str) -> int:
        if self.sample is None:
            return DEFAULT_TOKEN_ID
        if isinstance(self.sample, dict):
            scripted = self.sample.get(request_id)
            return scripted.pop(0) if scripted else DEFAULT_TOKEN_ID
        return self.sample(request_id)

    def execute(self, scheduled: SchedulerOutput, with_logprobs: bool = False) -> ModelRunnerOutput:
        self._apply(scheduled)
        request_ids, sampled, logprobs = [], [], []
        prompt_logprobs = {}
        for request_id, num_tokens in scheduled.num_scheduled_tokens.items():
            if self.params[request_id].prompt_logprobs is not None:
                prompt_logprobs[request_id] = self._prompt_logprobs(request_id, num_tokens)
            self.num_computed[request_id] += num_tokens
            if self.num_computed[request_id] == len(self.tokens[request_id]):
                token_id = self._sample(request_id)
                request_ids.append(request_id)
                sampled.append([token_id])
                logprobs.append([TokenLogprobs([token_id], [-0.5], [1])])
        return ModelRunnerOutput(
            step_id=scheduled.step_id,
            request_ids=request_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs if with_logprobs else None,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(self, request_id: str, num_tokens: int) -> list[TokenLogprobs]:
        """Computing token i scores token i + 1: prompt positions 1..P-1 in all."""
        start = self.num_computed[request_id]
        prompt = self.tokens[request_id][: self.scheduler.requests[request_id].num_prompt_tokens]
        end = min(start + num_tokens, len(prompt) - 1)
        return [TokenLogprobs([prompt[i + 1]], [-1.0], [1]) for i in range(start, end)]

    def _apply(self, scheduled: SchedulerOutput) -> None:
        for request_id in scheduled.finished_request_ids:
            assert request_id in self.tokens, f"told to drop {request_id}, which it does not hold"
            for state in (self.tokens, self.block_ids, self.num_computed, self.params):
                del state[request_id]
        for new in scheduled.new_requests:
            assert new.request_id not in self.tokens, f"{new.request_id} sent in full twice"
            self.tokens[new.request_id] = list(new.prompt_token_ids) + list(new.output_token_ids)
            self.block_ids[new.request_id] = list(new.block_ids)
            self.num_computed[new.request_id] = new.num_computed_tokens
            self.params[new.request_id] = new.sampling_params
        for cached in scheduled.cached_requests:
            assert self.num_computed[cached.request_id] == cached.num_computed_tokens
            self.tokens[cached.request_id].extend(cached.new_token_ids)
            self.block_ids[cached.request_id].extend(cached.new_block_ids)
        self._check_against_scheduler(scheduled)

    def _check_against_scheduler(self, scheduled: SchedulerOutput) -> None:
        named = {r.request_id for r in scheduled.new_requests} | {r.request_id for r in scheduled.cached_requests}
        assert named == set(scheduled.num_scheduled_tokens), "the output names other requests than it schedules"
        block_size = self.scheduler.block_size
        for request_id, num_tokens in scheduled.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            assert self.tokens[request_id] == request.all_token_ids
            assert self.block_ids[request_id] == self.scheduler.kv_cache_manager.get_block_ids(request_id)
            assert self.num_computed[request_id] == request.num_computed_tokens
            end = request.num_computed_tokens + num_tokens
            assert 0 < num_tokens and end <= request.num_tokens
            assert len(self.block_ids[request_id]) * block_size >= end, "blocks do not cover the scheduled tokens"


def step(
    scheduler: Scheduler, worker: FakeWorker, with_logprobs: bool = False
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    scheduled = scheduler.schedule()
    assert scheduled.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
    assert len(scheduled.num_scheduled_tokens) <= scheduler.max_num_seqs
    assert_decodes_first(scheduler, scheduled)
    outputs = scheduler.update_from_output(scheduled, worker.execute(scheduled, with_logprobs))
    scheduler.kv_cache_manager.check_invariants()
    return scheduled, outputs


def assert_decodes_first(scheduler: Scheduler, scheduled: SchedulerOutput) -> None:
    """In batch order, every one-token decode comes before every other request."""
    flags = []
    for request_id, num_tokens in scheduled.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        flags.append(num_tokens == 1 and request.num_computed_tokens >= request.num_prompt_tokens)
    assert flags == sorted(flags, reverse=True), f"decodes are not first: {scheduled.num_scheduled_tokens}"


def run_to_completion(
    scheduler: Scheduler, worker: FakeWorker | None = None, max_steps: int = 10_000
) -> dict[str, list[EngineCoreOutput]]:
    """Step until nothing is left, then flush the finished ids to the worker."""
    worker = worker or FakeWorker(scheduler)
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for _ in range(max_steps):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        _, step_outputs = step(scheduler, worker)
        for output in step_outputs:
            outputs.setdefault(output.request_id, []).append(output)
    else:
        raise AssertionError(f"not done after {max_steps} steps")
    assert not worker.tokens, f"the worker still holds {sorted(worker.tokens)}"
    return outputs


def output_token_ids(outputs: list[EngineCoreOutput]) -> list[int]:
    return [token_id for output in outputs for token_id in output.new_token_ids]
