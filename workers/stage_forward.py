"""The forward of one step on this worker's pipeline stage: the previous
stage's hidden states in, the model (compiled for decode steps with
--compilation-config mode torch_compile, else eager), the result on to the
next stage or back to the runner on the last."""
from __future__ import annotations

import torch

from fleet.config.fleet import FleetConfig
from fleet.parallel.comm import get_pp_group
from fleet.workers.compiled_decode import CompiledDecode
from fleet.workers.input_batch import StepBatch


class StageForward:
    def __init__(self, config: FleetConfig, model: torch.nn.Module, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.dtype = dtype
        self.stage = get_pp_group()
        self.compiled = CompiledDecode(config, model, device) if config.compilation.mode == "torch_compile" else None

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """Compile the decode graphs before the first request (mode torch_compile)."""
        if self.compiled is not None:
            with torch.inference_mode():  # as the steps run: the graphs guard on it
                self.compiled.warm_up(kv_caches, self.dtype)

    def __call__(self, batch: StepBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
        """The last stage's final hidden states [num_tokens, hidden]; None on an
        earlier stage, which has sent its own to the next."""
        intermediate = None
        if not self.stage.is_first:
            shape = (2, len(batch.input_ids), self.model.spec.hidden_size)  # hidden and residual
            intermediate = self.stage.recv_prev(shape, self.dtype, self.device)
        forward = self.model
        if self.compiled is not None and self.compiled.applies(batch.attention):
            forward = self.compiled
        hidden = forward(batch.input_ids, batch.positions, kv_caches, batch.attention, intermediate)
        if not self.stage.is_last:
            self.stage.send_next(hidden)
            return None
        return hidden
