"""What the workers compile."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fleet.config.fields import HumanInt


@dataclass(frozen=True)
class CompilationConfig:
    """Compilation: what the workers compile (--compilation-config)."""

    mode: Literal["none", "torch_compile"] = "none"
    """none: eager PyTorch. torch_compile: compile the decode step with torch.compile."""
    max_batch_size: HumanInt = 256
    """Largest decode batch that runs compiled; larger ones run eager."""
    batch_sizes: list[int] = field(default_factory=list)
    """Batch sizes compiled ahead of the first request. Empty: compile on first use."""
