"""One step on one worker: SchedulerOutput -> batch tensors -> forward -> sample; and its KV cache."""
from __future__ import annotations

import math
import mmap

import torch

from fleet.config.fleet import FleetConfig
from fleet.core.kv_blocks import kv_bytes_per_block
from fleet.core.messages import ModelRunnerOutput, SchedulerOutput
from fleet.workers.input_batch import CachedRequests
from fleet.workers.kv_transfer import WorkerKVTransfer
from fleet.workers.runner_output import RunnerOutputBuilder
from fleet.workers.stage_forward import StageForward

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    """One step is three collaborators in turn: the batch (input_batch.py),
    the stage's forward (stage_forward.py), the output (runner_output.py)."""

    def __init__(self, config: FleetConfig, model: torch.nn.Module, device: torch.device, is_driver: bool = True):
        self.config = config
        self.is_driver = is_driver
        # Replicas in lock-step run a forward every step, with no tokens if need
        # be, so that the expert-parallel collectives of the others complete.
        self.forward_every_step = config.parallel.replicas_step_together
        self.model = model
        self.device = device
        self.dtype = TORCH_DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.states = CachedRequests(device, self.block_size)
        self.forward = StageForward(config, model, device, self.dtype)
        self.outputs = RunnerOutputBuilder(config, model, is_driver)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_transfer: WorkerKVTransfer | None = None
        """Prefill/decode disaggregation (set by the worker when --kv-transfer-config is given)."""

    # ---- KV cache -------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.block_size, self.model.num_kv_heads, self.model.head_dim,
                                  self.model.num_layers, self.dtype.itemsize)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        allocate = _zeros_committed_on_use if self.device.type == "cpu" else torch.zeros
        self.kv_caches = [allocate(shape, dtype=self.dtype, device=self.device) for _ in range(self.model.num_layers)]
        self.forward.warm_up(self.kv_caches)

    # ---- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Every worker runs it (collectives need all of them);
        only the driver (tensor rank 0 of the last stage) returns an output."""
        self.states.apply(scheduler_output)
        loads_done, load_failed = [], {}
        if self.kv_transfer is not None:
            loads_done, load_failed = self.kv_transfer.step(scheduler_output, self.kv_caches)
        output = self._run(scheduler_output)
        if output is not None:
            output.kv_loads_done, output.kv_load_failed = loads_done, load_failed
        return output

    def _run(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        step_id = scheduler_output.step_id
        if not scheduler_output.num_scheduled_tokens and not self.forward_every_step:
            return ModelRunnerOutput(step_id=step_id, request_ids=[], sampled_token_ids=[]) if self.is_driver else None
        batch = self.states.build_batch(scheduler_output)
        hidden = self.forward(batch, self.kv_caches)
        if hidden is None:  # an earlier pipeline stage
            return None
        return self.outputs.build(step_id, batch, hidden)


def _zeros_committed_on_use(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros in an anonymous mapping: the kernel hands out zero pages as they
    are first written, so the KV cache holds RAM for the blocks used, not for
    its whole budget (torch.zeros would write every page at start-up). The
    mapping is still reserved memory to Linux (Committed_AS), which the
    memory plan of a later launch counts as used."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


