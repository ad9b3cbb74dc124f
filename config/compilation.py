"""What the workers compile."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from fleet.config.fields import HumanInt


@dataclass(frozen=True)
class CompilationConfig:
    """Compilation: what the workers compile (--compilation-config)."""

    mode: Literal["none", "torch_compile"] = "none"
    """none: eager PyTorch, with fleet's fused CPU kernels. torch_compile (compiling the decode step) is not built yet: a launch that asks for it is refused rather than run eager under that name."""
    max_batch_size: HumanInt = 256
    """For torch_compile: the largest decode batch that would run compiled."""
    batch_sizes: list[int] = field(default_factory=list)
    """For torch_compile: batch sizes to compile ahead of the first request."""

    def check_built(self) -> None:
        """Refuse a mode that would do nothing: ValueError naming the flag and what works."""
        if self.mode != "none":
            raise ValueError(f"--compilation-config mode {self.mode!r} is not built yet: fleet runs eager PyTorch "
                             "with its fused CPU kernels; use mode none (the default)")
