"""How the engine core batches requests into steps."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fleet.config.fields import HumanInt


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler: how requests are batched into steps."""

    max_num_batched_tokens: HumanInt | None = None
    """Token budget of one step, prompt and generated tokens together. Unset: 2048 on CPU, 8192 on CUDA (at least the model length when chunked prefill is off)."""
    max_num_seqs: int | None = None
    """Most requests in one step. Unset: 128 on CPU, 256 on CUDA."""
    enable_chunked_prefill: bool | None = None
    """Split long prompts over several steps so that decodes keep running. Unset: on."""
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """Order of waiting requests: first come first served, or by the request's priority (lower first), then arrival."""
