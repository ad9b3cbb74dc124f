"""The engine core's step logic: schedule -> execute -> update, one step at a time.

The engine-core process around it (sockets, threads, lock-step votes) is
core/launch/engine_process.py, which also builds its executor."""
from __future__ import annotations

import logging
import time
from typing import Any

import msgspec

from fleet.config.fleet import FleetConfig
from fleet.core.executor import Executor
from fleet.core.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineLoad,
    FinishReason,
    KVCapacity,
    ModelRunnerOutput,
    SpecDecodeCounts,
)
from fleet.core.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EngineCore:
    """Owns the scheduler and the executor of one data-parallel replica."""

    UTILITY_METHODS = ("health", "reset_prefix_cache", "kv_stats", "spec_decode_stats")

    def __init__(self, config: FleetConfig, executor: Executor, dp_rank: int, relays_prompt_blocks: bool):
        """`relays_prompt_blocks`: report the prompt blocks taken in each load (several API servers route by them)."""
        self.config = config
        self.dp_rank = dp_rank
        self.executor = executor
        self.kv_capacity: KVCapacity = self.executor.start()
        self.scheduler = Scheduler(
            config.scheduler,
            config.cache,
            max_model_len=config.model.max_model_len,
            num_blocks=self.kv_capacity.num_blocks,
            eos_token_ids=config.model.eos_token_ids,
            sliding_window=config.model.sliding_window,
            kv_transfer=config.kv_transfer,
            replica_size=config.parallel.tensor_parallel_size * config.parallel.pipeline_parallel_size,
            speculative=config.speculative,
        )
        self.kv_release_address: str | None = None
        """Producer: where decode instances say they took a request's KV (bound by the process)."""
        self.client_of_request: dict[str, int] = {}
        self.rejected: list[tuple[int, EngineCoreOutput]] = []
        self.new_prompt_blocks: list[bytes] | None = [] if relays_prompt_blocks else None
        """Prompt blocks taken since the last load() (EngineLoad.new_prompt_blocks); None: not reported."""
        self._log_capacity()

    def _log_capacity(self) -> None:
        capacity = self.kv_capacity
        concurrency = capacity.num_tokens / self.config.model.max_model_len
        logger.info(
            "engine dp%d: KV cache of %d blocks = %d tokens; %.2fx concurrency at max model length %d",
            self.dp_rank, capacity.num_blocks, capacity.num_tokens, concurrency, self.config.model.max_model_len,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request; one the scheduler refuses is answered with an error
        output instead (front ends validate first, so this is a last guard)."""
        try:
            added = self.scheduler.add_request(request)
        except ValueError as error:
            logger.warning("rejected request %s: %s", request.request_id, error)
            rejection = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR, error=str(error))
            self.rejected.append((request.client_index, rejection))
            return
        self.client_of_request[request.request_id] = request.client_index
        if self.new_prompt_blocks is not None:
            self.new_prompt_blocks += added.block_hashes

    def abort(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests([r for r in request_ids if r in self.client_of_request])

    def has_work(self) -> bool:
        scheduler = self.scheduler
        return scheduler.has_unfinished_requests() or scheduler.has_finished_requests() or bool(self.rejected)

    def step(self) -> dict[int, EngineCoreOutputs]:
        """Run one step; return the outputs grouped by the client that gets them."""
        scheduler_output = self.scheduler.schedule()
        # Workers must drop finished requests too; and lock-step replicas all
        # run every step, with no tokens if need be (see dp_coordinator.py).
        workers_have_work = (scheduler_output.num_scheduled_tokens or scheduler_output.finished_request_ids
                             or scheduler_output.kv_exports or scheduler_output.kv_export_releases
                             or self.scheduler.kv_connector.loading)  # the workers say when pulls end
        if workers_have_work or self.config.parallel.replicas_step_together:
            result = self.executor.execute(scheduler_output)
        else:
            result = ModelRunnerOutput(step_id=scheduler_output.step_id, request_ids=[], sampled_token_ids=[])
        outputs = self.scheduler.update_from_output(scheduler_output, result)
        for output in outputs:
            if output.kv_transfer is not None:
                output.kv_transfer.remote_kv_addresses = self.executor.kv_export_addresses
                output.kv_transfer.remote_release_address = self.kv_release_address
        return self._group_by_client(outputs)

    def take_kv_releases(self) -> list[tuple[str, str]]:
        """(release address, transfer id) to tell prefill instances (the process sends them, kv_release.py)."""
        return self.scheduler.kv_connector.take_releases()

    def release_kv(self, transfer_id: str) -> None:
        self.scheduler.kv_connector.release(transfer_id)

    def _group_by_client(self, outputs: list[EngineCoreOutput]) -> dict[int, EngineCoreOutputs]:
        now = time.time()
        grouped: dict[int, EngineCoreOutputs] = {}

        def bucket(client: int) -> list[EngineCoreOutput]:
            if client not in grouped:
                grouped[client] = EngineCoreOutputs(self.dp_rank, [], now)
            return grouped[client].outputs

        for client, output in self.rejected:
            bucket(client).append(output)
        self.rejected.clear()
        for output in outputs:
            client = self.client_of_request.get(output.request_id, 0)
            if output.finish_reason is not None:
                self.client_of_request.pop(output.request_id, None)
            bucket(client).append(output)
        self._attach_stats(grouped)
        return grouped

    def _attach_stats(self, grouped: dict[int, EngineCoreOutputs]) -> None:
        """The scheduler's stats go out with the outputs. The counts since
        the last stats (prefix-cache lookups, preemptions) go to one client
        only, so that the API servers' counters add up; a step with no
        outputs keeps them for the next one that has some."""
        if not grouped:
            return
        stats = self.scheduler.make_stats()
        first, *others = sorted(grouped)
        grouped[first].scheduler_stats = stats
        occupancy = msgspec.structs.replace(stats, prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                                              kv_transfer_tokens=0, kv_transfer_failures=0,
                                              spec_decode=SpecDecodeCounts())
        for client in others:
            grouped[client].scheduler_stats = occupancy

    def load(self) -> EngineLoad:
        scheduler = self.scheduler
        blocks = self.new_prompt_blocks or []
        if blocks:
            self.new_prompt_blocks = []
        return EngineLoad(self.dp_rank, len(scheduler.waiting), len(scheduler.running), blocks)

    def utility(self, method: str, args: list[Any]) -> Any:
        if method == "health":
            return True
        if method == "reset_prefix_cache":
            return self.scheduler.kv_cache_manager.reset_prefix_cache()
        if method == "kv_stats":
            manager = self.scheduler.kv_cache_manager
            return {"num_free_blocks": manager.num_free_blocks, "num_blocks": manager.num_blocks}
        if method == "spec_decode_stats":
            return msgspec.structs.asdict(self.scheduler.spec_decode_totals)
        raise ValueError(f"unknown utility {method!r}; choose from {self.UTILITY_METHODS}")

    def shutdown(self) -> None:
        self.executor.shutdown()
