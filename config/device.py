"""Which device the workers compute on."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class DeviceConfig:
    """Device: what the workers compute on."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device of the workers. auto: cuda when a GPU is visible, else cpu."""

    @property
    def distributed_backend(self) -> str:
        """torch.distributed backend for collectives between workers."""
        return "nccl" if self.device == "cuda" else "gloo"

    def resolve(self) -> DeviceConfig:
        if self.device != "auto":
            return self
        return DeviceConfig(device="cuda" if _cuda_available() else "cpu")


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch  # deferred: only `auto` needs it, and it is slow to import

    return torch.cuda.is_available()
