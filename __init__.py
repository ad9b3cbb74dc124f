"""fleet: a multi-process, distributed LLM server with an OpenAI-compatible API."""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs"]

if TYPE_CHECKING:
    from fleet.config.engine_args import EngineArgs
    from fleet.core.sampling_params import SamplingParams
    from fleet.frontend.llm import LLM


def __getattr__(name: str):
    # Lazy, so that `import fleet` (and every child process) stays light.
    if name == "LLM":
        from fleet.frontend.llm import LLM

        return LLM
    if name == "SamplingParams":
        from fleet.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineArgs":
        from fleet.config.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
