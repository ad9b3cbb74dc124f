"""Where and how weights are read."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LoadConfig:
    """Loading: weight format and download folder."""

    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    """Weight format: auto (from the model path), safetensors, gguf, or dummy (random weights, for benchmarks)."""
    download_dir: str | None = None
    """Cache folder for models fetched from the Hugging Face hub. Unset: the hub's default."""
