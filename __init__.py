"""fleet: a multi-process, distributed LLM server with an OpenAI-compatible API."""
from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineArgs"]



def _forget_checkout_root() -> None:
    """Take this package's own directory (the checkout root) and its direct
    subfolders off `sys.path`.

    fleet's top-level folders (`kernels`, `config`, `core`, `tests`, ...) share
    their names with packages on the index: with the checkout root on the path
    (`python -m ...` or a REPL started there, a script run from `scripts/`),
    `import kernels` inside transformers would find our `kernels/` instead of
    Hugging Face's. Every fleet process imports `fleet` before anything else,
    so dropping those entries here keeps each of them from shadowing. A
    virtualenv inside the checkout is deeper than one level and stays.
    """
    root = os.path.dirname(os.path.abspath(__file__))

    def inside(entry: str) -> bool:
        path = os.path.abspath(entry or os.curdir)
        return path == root or os.path.dirname(path) == root

    sys.path[:] = [entry for entry in sys.path if not inside(entry)]


_forget_checkout_root()


def _hold_torch_to_the_cpu_class() -> None:
    """Under FLEET_CPU_ISA, set torch's, oneDNN's and MKL's own variables before torch
    loads: every fleet process (launcher, engine, worker, a test run) imports
    `fleet` first. A bad value is left for the CLI or the engine to refuse in
    one line (config/cpu_class.py), not raised while importing."""
    if not os.environ.get("FLEET_CPU_ISA"):
        return
    from fleet.config import env
    from fleet.config.cpu_class import torch_environment

    try:
        env.hold_torch_to(torch_environment())
    except ValueError:
        pass


_hold_torch_to_the_cpu_class()

if TYPE_CHECKING:
    from fleet.config.engine_args import EngineArgs
    from fleet.core.sampling_params import SamplingParams, StructuredOutputsParams
    from fleet.frontend.llm import LLM


def __getattr__(name: str):
    # Lazy, so that `import fleet` (and every child process) stays light.
    if name == "LLM":
        from fleet.frontend.llm import LLM

        return LLM
    if name in ("SamplingParams", "StructuredOutputsParams"):
        from fleet.core import sampling_params

        return getattr(sampling_params, name)
    if name == "EngineArgs":
        from fleet.config.engine_args import EngineArgs

        return EngineArgs
    raise AttributeError(name)
