"""Scheduler: continuous batching under one token budget per step.

Each request has `num_computed_tokens` that catches up with `num_tokens`; every
step hands out `max_num_batched_tokens` tokens, running requests first, then
waiting ones. A prompt, a prefill chunk, a decode and a recompute after
preemption are all the same thing: tokens not yet computed. No phases.

One step, as the engine core drives it:
    scheduler_output = scheduler.schedule()         # SchedulerOutput, the workers' contract
    runner_output = executor.execute(scheduler_output)  # ModelRunnerOutput
    outputs = scheduler.update_from_output(scheduler_output, runner_output)
When only finished ids or abort outputs are pending (has_finished_requests), the
SchedulerOutput schedules no token; the engine core may skip the executor and pass an empty
ModelRunnerOutput with its step_id.

Fair share. A user request with n = 64 is 64 engine requests of one group
(Request.group_id); without care four of them fill the batch for minutes and a
4-token chat waits behind all 256 sequences. So groups share the batch:
  - Admission takes the waiting request whose group runs the fewest sequences
    (request_queue.py: ties, and the priority policy, keep their order). The head
    blocks the rest, so a big prompt is not starved by small ones.
  - When that head finds no room (max_num_seqs, or too few KV blocks) and its group
    runs at least two sequences fewer than the biggest group, the biggest group's
    most recently admitted sequence is preempted (recomputed later) to make room for
    that one request (so groups rebalance by one sequence a step), before the running
    requests are scheduled, so no request scheduled this step is ever the victim; at
    most MAX_FAIR_SHARE_PREEMPTIONS_PER_STEP a step. Each such swap narrows the gap
    between two groups, so swaps cannot go round in circles.
  - A running request short of blocks preempts, among itself and the requests not
    yet scheduled this step, the biggest group's latest sequence (with groups of one,
    the last request, as before), so a newly admitted small request is not the first
    to go.
  - A step that preempted admits only heads of under-served groups (never a request
    preempted in the same step): admitting while evicting only thrashes the cache, but
    big groups that keep growing and preempting each other must not lock a small one out.
Under the priority policy, priority comes first everywhere: fair share never preempts
a request of better priority than the waiting one, nor admits a worse one ahead of it.

Speculative decoding (--speculative-config): a running request with one token left to
compute may also compute draft tokens after it (core/ngram_proposer.py), which count in
its num_scheduled_tokens and go to the workers in spec_token_ids. Only the drafts the
model kept count as computed afterwards (update_from_output).
"""
from __future__ import annotations

import time
from collections.abc import Collection, Iterable

import msgspec

from fleet.config.cache import CacheConfig
from fleet.config.kv_transfer import KVTransferConfig
from fleet.config.scheduler import SchedulerConfig
from fleet.config.speculative import SpeculativeConfig
from fleet.core.kv_blocks import holds_a_full_sequence
from fleet.core.kv_cache_manager import KVCacheManager
from fleet.core.kv_connector import KVConnector, remote_prefill
from fleet.core.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodeCounts,
    TokenLogprobs,
)
from fleet.core.ngram_proposer import NgramProposer
from fleet.core.request import Request, RequestStatus
from fleet.core.request_queue import FCFSQueue, PriorityQueue, priority_key
from fleet.core.step_builder import SchedulerOutputBuilder, StepBudget
from fleet.core.validation import RequestLimits, check_prompt

MAX_FAIR_SHARE_PREEMPTIONS_PER_STEP = 4
"""Sequences one step may preempt to let an under-served group in (module docstring)."""


def _check_configs(
    scheduler_config: SchedulerConfig, cache_config: CacheConfig, max_model_len: int, num_blocks: int
) -> None:
    fields = {
        "max_num_batched_tokens": scheduler_config.max_num_batched_tokens,
        "max_num_seqs": scheduler_config.max_num_seqs,
        "enable_chunked_prefill": scheduler_config.enable_chunked_prefill,
        "enable_prefix_caching": cache_config.enable_prefix_caching,
    }
    unresolved = [name for name, value in fields.items() if value is None]
    if unresolved:
        raise ValueError(f"unresolved config fields {unresolved}: build configs with EngineArgs.create_config()")
    if not holds_a_full_sequence(num_blocks, max_model_len, cache_config.block_size):
        # A request growing to max_model_len would preempt itself and never run again.
        raise ValueError(
            f"the KV cache ({num_blocks=} x block_size={cache_config.block_size}) holds fewer tokens than "
            f"{max_model_len=}; lower --max-model-len or give the KV cache more memory"
        )


class Scheduler:
    """Decides which requests compute how many tokens each step, and applies the results.

    Args:
        scheduler_config / cache_config: resolved configs (EngineArgs.create_config).
        max_model_len: context length; a request reaching it finishes ("length").
        num_blocks: KV capacity in blocks, as the workers allocated it.
        eos_token_ids: every token that ends the model's generation (none for a model without).
    """

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        max_model_len: int,
        num_blocks: int,
        eos_token_ids: Collection[int],
        sliding_window: int | None = None,
        kv_transfer: KVTransferConfig | None = None,
        replica_size: int = 1,
        speculative: SpeculativeConfig | None = None,
    ):
        _check_configs(scheduler_config, cache_config, max_model_len, num_blocks)
        self.max_num_batched_tokens: int = scheduler_config.max_num_batched_tokens
        self.max_num_seqs: int = scheduler_config.max_num_seqs
        self.enable_chunked_prefill: bool = scheduler_config.enable_chunked_prefill
        self.policy = scheduler_config.scheduling_policy
        self.max_model_len = max_model_len
        self.limits = RequestLimits(max_model_len, None if self.enable_chunked_prefill else self.max_num_batched_tokens)
        """What a request's prompt must fit (core/validation.py: the front ends checked it first)."""
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(num_blocks, self.block_size, cache_config.enable_prefix_caching,
                                               sliding_window)

        self.requests: dict[str, Request] = {}
        """Unfinished requests by id."""
        self.waiting: FCFSQueue | PriorityQueue = PriorityQueue() if self.policy == "priority" else FCFSQueue()
        self.running: list[Request] = []
        self._output_builder = SchedulerOutputBuilder()
        self._pending_outputs: list[EngineCoreOutput] = []
        """Outputs of requests finished outside a step (aborts), sent with the next update."""
        self._held_outputs: list[EngineCoreOutput] = []
        """Last outputs of prompts held for a decode instance, whose workers have not been told
        of the export yet: a decode instance that pulled now would find nothing to pull."""
        self._held_outputs_by_step: dict[int, list[EngineCoreOutput]] = {}
        """Those told of in a step in flight (by step id): they go out once that step is done."""
        self.step_counter = 0
        self.num_preemptions = 0
        self.kv_connector = KVConnector(kv_transfer, self.kv_cache_manager, self.block_size, replica_size)
        """Prefill/decode disaggregation: held exports, pulls in flight, releases to send."""
        self.loaded: list[Request] = []
        """Requests whose prompt's KV arrived from a prefill instance: admitted before the waiting queue."""
        self._last_stats = (0, 0, 0, 0, 0)
        self.proposer = NgramProposer(speculative) if speculative is not None else None
        """Speculative decoding: drafts for requests with one token left to compute."""
        self.spec_decode_totals = SpecDecodeCounts()
        self._last_spec_decode = SpecDecodeCounts()

    # ---- requests in ----------------------------------------------------------------------

    def add_request(self, core_request: EngineCoreRequest) -> Request:
        """Queue a request. Raises ValueError for one that could never run."""
        request_id = core_request.request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_prompt(self.limits, core_request.prompt_token_ids)
        block_size = self.block_size if self.kv_cache_manager.enable_caching else None
        core_request = self.kv_connector.admit(core_request)
        request = Request(
            core_request, eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, block_size=block_size
        )
        self.requests[request_id] = request
        self.waiting.add(request)
        return request

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """End requests in any state now (unknown or finished ids are ignored); their
        blocks are free at once and their "abort" outputs come with the next update."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            pulling = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and request not in self.loaded
            if request.status == RequestStatus.RUNNING:
                self._remove_running(request)
            elif request in self.loaded:
                self.loaded.remove(request)
            elif not pulling:
                self.waiting.remove(request)
                self.kv_connector.give_up(request)
            request.finish(RequestStatus.FINISHED_ABORTED)
            if pulling:  # a worker may still write into its blocks: they are freed when the pull ends
                del self.requests[request_id]
            else:
                self._release(request)
            self._pending_outputs.append(self._output(request, []))

    # ---- the scheduler output -----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.kv_connector.exports.expire()
        step = StepBudget(token_budget=self.max_num_batched_tokens)
        made_room_for = self._preempt_for_fair_share(step)
        self._schedule_running(step)
        self._schedule_loaded(step)
        self._schedule_waiting(step, made_room_for)
        self.step_counter += 1
        output = self._output_builder.build(self.step_counter, step)
        output.kv_exports, output.kv_export_releases = self.kv_connector.exports.take_changes()
        if self._held_outputs:
            self._held_outputs_by_step[output.step_id], self._held_outputs = self._held_outputs, []
        return output

    def _preempt_for_fair_share(self, step: StepBudget) -> Request | None:
        """Make room for the waiting head if it finds none and its group is under-served; returns
        it if anything was preempted for it. Runs before anything is scheduled this step, so no
        victim is in the step. The victims' groups still run more than the head's: it stays the head."""
        if not self.waiting:
            return None
        request = self.waiting.peek()
        num_preempted = 0
        while num_preempted < MAX_FAIR_SHARE_PREEMPTIONS_PER_STEP and not self._finds_room(request):
            victim = self._fair_share_victim(request)
            if victim is None:
                break
            self._preempt(victim)
            step.preempted.append(victim)
            num_preempted += 1
        return request if num_preempted else None

    def _finds_room(self, request: Request) -> bool:
        """Whether `request` could be admitted now: a free sequence slot, and free blocks for its
        next chunk (an estimate: the running requests' growth this step is not counted)."""
        if len(self.running) >= self.max_num_seqs:
            return False
        kv = self.kv_cache_manager
        computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
        num_tokens = min(request.num_tokens, num_computed_tokens + self.max_num_batched_tokens)
        num_held_hits = sum(1 for block in computed_blocks if block.ref_count > 0)  # cost no free block
        return -(-num_tokens // self.block_size) - num_held_hits <= kv.num_free_blocks

    def _fair_share_victim(self, waiting_request: Request) -> Request | None:
        """The running sequence to preempt for `waiting_request`: the latest of the biggest group,
        if that group runs at least two more sequences than the waiting one's (one more and
        the swap would only trade places). None: the waiting request's group is not under-served.
        Under the priority policy only requests of no better priority are candidates."""
        candidates = self.running
        if self.policy == "priority":
            candidates = [r for r in candidates if r.priority >= waiting_request.priority]
        victim = self._latest_of_biggest_group(candidates)
        num_running = self.waiting.num_running
        if victim is None or num_running(victim.group_id) < num_running(waiting_request.group_id) + 2:
            return None
        return victim

    def _latest_of_biggest_group(self, candidates: list[Request]) -> Request | None:
        """The candidate of the group with the most running sequences that comes last in `running`
        (the most recently admitted; ties between groups: the later one too)."""
        num_running = self.waiting.num_running
        return max(reversed(candidates), key=lambda request: num_running(request.group_id), default=None)

    def _schedule_running(self, step: StepBudget) -> None:
        """Running requests in policy order; one short of blocks preempts one not yet scheduled."""
        if self.policy == "priority":
            self.running.sort(key=priority_key)
        index = 0
        while index < len(self.running) and step.token_budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, step.token_budget)
            assert num_new_tokens > 0, f"running {request} has nothing to compute"
            if num_new_tokens == 1 and self._schedule_with_drafts(request, step):
                index += 1
                continue
            new_block_ids = self._allocate_or_preempt(index, num_new_tokens, step)
            if new_block_ids is not None:
                step.add(request, num_new_tokens, new_block_ids)
                index += 1
            # else it was preempted itself, and the next request moved up to `index`.

    def _schedule_with_drafts(self, request: Request, step: StepBudget) -> bool:
        """Speculative decoding: schedule the request's last token and draft tokens after it, if the
        proposer has some and free blocks hold them (drafts never preempt anyone). False: not scheduled."""
        if self.proposer is None or request.pooling is not None or request.sampling_params.structured_outputs:
            return False  # a grammar's state moves token by token: constrained requests take no drafts
        useful = min(step.token_budget, request.max_tokens - request.num_output_tokens,
                     self.max_model_len - request.num_tokens) - 1  # the step also samples one token of its own
        drafts = self.proposer.propose(request.all_token_array(), useful)
        if not drafts:
            return False
        new_block_ids = self.kv_cache_manager.allocate_slots(request, 1 + len(drafts))
        if new_block_ids is None:
            return False
        step.add(request, 1 + len(drafts), new_block_ids, drafts)
        return True

    def _allocate_or_preempt(self, index: int, num_new_tokens: int, step: StepBudget) -> list[int] | None:
        """Preempt until `running[index]` fits; None if it was preempted itself. Victims come from
        `running[index:]`: requests scheduled earlier this step sit before it and are never the victim."""
        request = self.running[index]
        while True:
            new_block_ids = self._allocate(request, num_new_tokens)
            if new_block_ids is not None:
                return new_block_ids
            victim = self._growth_victim(index)
            self._preempt(victim)
            step.preempted.append(victim)
            if victim is request:
                return None

    def _growth_victim(self, index: int) -> Request:
        """Who gives up its blocks when `running[index]` needs more: among it and the requests
        after it, the latest of the biggest group; under the priority policy, of the worst
        priority first (`running` is sorted, so the last request has it)."""
        candidates = self.running[index:]
        if self.policy == "priority":
            worst = candidates[-1].priority
            candidates = [r for r in candidates if r.priority == worst]
        return self._latest_of_biggest_group(candidates)

    def _schedule_waiting(self, step: StepBudget, made_room_for: Request | None) -> None:
        """Admit from the head of the waiting queue; the head blocks the rest (no starvation).
        `made_room_for`: the head that fair share preempted for this step."""
        kv = self.kv_cache_manager
        while self.waiting and step.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if step.preempted and not self._admits_while_preempting(request, step, made_room_for):
                break
            computed_blocks, num_computed_tokens = kv.get_computed_blocks(request)
            if remote_prefill(request) is not None:
                if not self._start_remote_load(request, computed_blocks, num_computed_tokens, step):
                    break
                continue
            num_new_tokens = request.num_tokens - num_computed_tokens
            if num_new_tokens > step.token_budget:
                if not self.enable_chunked_prefill:
                    break
                num_new_tokens = step.token_budget
            new_block_ids = self._allocate(request, num_new_tokens, computed_blocks)
            if new_block_ids is None:
                break
            self._start_running(request, num_computed_tokens, num_new_tokens, new_block_ids, step)

    def _start_running(self, request: Request, num_computed_tokens: int, num_new_tokens: int,
                       new_block_ids: list[int], step: StepBudget) -> None:
        self.waiting.pop()
        request.start_running(num_computed_tokens)
        self.running.append(request)
        self.waiting.started_running(request)
        step.add(request, num_new_tokens, new_block_ids)

    def _allocate(self, request: Request, num_new_tokens: int, computed_blocks: list | None = None
                  ) -> list[int] | None:
        """allocate_slots, first freeing KV held for decode instances if that is what it takes:
        this instance's own requests come before a transfer (whose consumer can compute it)."""
        kv = self.kv_cache_manager
        while True:
            new_block_ids = kv.allocate_slots(request, num_new_tokens, computed_blocks)
            if new_block_ids is not None or not self.kv_connector.exports.release_oldest():
                return new_block_ids

    def _start_remote_load(self, request: Request, computed_blocks: list, num_computed_tokens: int,
                           step: StepBudget) -> bool:
        """The waiting head whose prompt a prefill instance computed: blocks for the whole prompt,
        and a KVLoad that pulls all but its last token while it waits (or, when the local prefix
        cache holds all of that, it runs at once). False: no room for its blocks (nothing changed)."""
        kv = self.kv_cache_manager
        new_block_ids = self._allocate(request, request.num_tokens - num_computed_tokens, computed_blocks)
        if new_block_ids is None:
            return False
        load = self.kv_connector.plan_load(request, num_computed_tokens, kv.get_block_ids(request.request_id))
        if load is None:
            self.kv_connector.give_up(request)
            self._start_running(request, num_computed_tokens, request.num_tokens - num_computed_tokens,
                                new_block_ids, step)
            return True
        self.waiting.pop()
        self.kv_connector.start_load(request, num_computed_tokens)
        step.kv_loads.append(load)
        return True

    def _schedule_loaded(self, step: StepBudget) -> None:
        """Requests whose pulled KV arrived: each computes its last prompt token, in arrival order."""
        while self.loaded and len(self.running) < self.max_num_seqs:
            request = self.loaded[0]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            if num_new_tokens > step.token_budget:
                return
            self.loaded.pop(0)
            request.start_running(request.num_computed_tokens)
            self.running.append(request)
            self.waiting.started_running(request)
            step.add(request, num_new_tokens, self.kv_cache_manager.get_block_ids(request.request_id))

    def _admits_while_preempting(self, request: Request, step: StepBudget, made_room_for: Request | None) -> bool:
        """In a step that preempted, admitting would mostly thrash the cache: only the request fair
        share made room for, or one of an under-served group, gets in (never one preempted this step)."""
        if request is made_room_for:
            return True
        return request not in step.preempted and self._fair_share_victim(request) is not None

    def _remove_running(self, request: Request) -> None:
        self.running.remove(request)
        self.waiting.stopped_running(request)

    def _preempt(self, request: Request) -> None:
        self._remove_running(request)
        self.kv_cache_manager.free(request)
        request.preempt()
        self.waiting.prepend(request)
        self._output_builder.forget(request.request_id)
        self.num_preemptions += 1

    # ---- results in ----------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's results: computed tokens, sampled tokens, stops, freed blocks.

        Returns one output per request that sampled or finished, and one per abort
        since the last update.
        """
        assert runner_output.step_id == scheduler_output.step_id, (runner_output.step_id, scheduler_output.step_id)
        outputs, self._pending_outputs = self._pending_outputs, []
        outputs += self._held_outputs_by_step.pop(scheduler_output.step_id, [])  # its workers now serve them
        sample_index = {request_id: index for index, request_id in enumerate(runner_output.request_ids)}
        self._settle_kv_loads(runner_output)
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran, or its KV load failed
            num_drafts = len(scheduler_output.spec_token_ids.get(request_id, ()))
            request.advance(num_tokens - num_drafts)  # the drafts' KV counts once they are accepted
            failure = runner_output.failed.get(request_id)
            embedding = runner_output.embeddings.get(request_id)
            if failure is not None:
                request.finish(RequestStatus.FINISHED_ERROR, error=failure)
                output = self._output(request, [])
            elif embedding is not None:
                request.finish(RequestStatus.FINISHED_STOPPED)
                output = self._output(request, [])
                output.embedding = embedding
            else:
                output = self._apply_sample(request, runner_output, sample_index.get(request_id), num_drafts)
            self.kv_cache_manager.cache_full_blocks(request)
            if request.is_finished:
                self._remove_running(request)
                normal = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)
                if output is not None and self.kv_connector.exports_kv(request, normal):
                    output.kv_transfer = self.kv_connector.hold(request)
                    self._output_builder.forget(request_id)
                    del self.requests[request_id]
                    self._held_outputs.append(output)  # after the next step tells the workers
                    continue
                self._release(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def _settle_kv_loads(self, runner_output: ModelRunnerOutput) -> None:
        """Pulls that ended: a request whose KV arrived waits to compute its last prompt token; one
        whose pull failed computes its prompt here (its blocks hold nothing valid: none is cached);
        one aborted meanwhile gives its blocks back now that no worker writes into them."""
        for request, arrived in self.kv_connector.finish_loads(runner_output):
            if arrived:
                self.loaded.append(request)
                continue
            self.kv_cache_manager.free(request)
            if not request.is_finished:
                request.remote_kv_lost()
                self.waiting.prepend(request)

    def _apply_sample(
        self, request: Request, runner_output: ModelRunnerOutput, index: int | None, num_drafts: int
    ) -> EngineCoreOutput | None:
        prompt_logprobs = runner_output.prompt_logprobs.get(request.request_id)
        if prompt_logprobs:
            request.add_prompt_logprobs(prompt_logprobs)
        if index is None:
            return None  # a prefill chunk that ended mid-sequence
        assert request.num_computed_tokens == request.num_tokens, f"{request} sampled before its last token"
        sampled = runner_output.sampled_token_ids[index]
        new_token_ids = request.append_output_token_ids(sampled)
        if num_drafts:
            # The accepted drafts' KV was computed this step; the token after them has none yet.
            num_accepted = len(sampled) - 1
            request.advance(min(len(new_token_ids), num_accepted))
            self.spec_decode_totals.add(num_drafts, num_accepted)
        logprobs = runner_output.logprobs[index] if runner_output.logprobs is not None else None
        return self._output(request, new_token_ids, None if logprobs is None else logprobs[: len(new_token_ids)])

    def _output(
        self, request: Request, new_token_ids: list[int], new_logprobs: list[TokenLogprobs] | None = None
    ) -> EngineCoreOutput:
        output = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            prompt_logprobs=request.take_prompt_logprobs(),
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            error=request.error,
            num_cached_tokens=request.num_cached_tokens,
        )
        first_token = new_token_ids and request.num_output_tokens == len(new_token_ids)
        if first_token and request.first_scheduled_at is not None:
            output.queue_time = request.first_scheduled_at - request.received_at
            output.prefill_time = time.monotonic() - request.first_scheduled_at
        return output

    def _release(self, request: Request) -> None:
        """A finished request leaves: blocks back to the pool, workers told to drop it."""
        self.kv_cache_manager.free(request)
        self._output_builder.forget(request.request_id)
        del self.requests[request.request_id]

    # ---- state -----------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or pulls to see end (an aborted request's blocks wait for its pull)."""
        return bool(self.requests) or bool(self.kv_connector.loading)

    def has_finished_requests(self) -> bool:
        """Finished ids or abort outputs not yet delivered: worth one more (empty) step."""
        return (self._output_builder.has_finished or bool(self._pending_outputs) or self.kv_connector.has_changes
                or bool(self._held_outputs) or bool(self._held_outputs_by_step))

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def make_stats(self) -> SchedulerStats:
        """Current occupancy, plus prefix-cache and preemption counts since the last call."""
        kv = self.kv_cache_manager
        connector = self.kv_connector
        totals = (kv.prefix_cache_queries, kv.prefix_cache_hits, self.num_preemptions, connector.num_loaded_tokens,
                  connector.num_failures)
        queries, hits, preemptions, transfer_tokens, transfer_failures = (
            now - before for now, before in zip(totals, self._last_stats, strict=True))
        self._last_stats = totals
        spec_decode = self.spec_decode_totals.minus(self._last_spec_decode)
        self._last_spec_decode = msgspec.structs.replace(self.spec_decode_totals)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting) + len(self.kv_connector.loading) + len(self.loaded),
            kv_cache_usage=kv.usage,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            num_preemptions=preemptions,
            step_counter=self.step_counter,
            kv_transfer_tokens=transfer_tokens,
            kv_transfer_failures=transfer_failures,
            spec_decode=spec_decode,
        )
