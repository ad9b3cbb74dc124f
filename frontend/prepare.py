"""`fleet prepare`: do now what a first launch would otherwise do before it
can answer, so that it starts at once. `make install` runs it for the default
model. Everything it makes is a cache that a launch also makes on first use."""
from __future__ import annotations

import logging
import time

from fleet.config.fleet import FleetConfig

logger = logging.getLogger("fleet.prepare")


def prepare(config: FleetConfig) -> int:
    """Derive the model's tokenizer (GGUF files: converted once and kept) and
    build the CPU kernels; the config was derived in resolving it. Weights
    need nothing: a GGUF file's are read as they are (kernels/quantized.py)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _timed("tokenizer", lambda: _tokenizer(config))
    if config.device.device == "cpu":
        _timed("CPU kernels", _cpu_kernels)
    return 0


def _timed(what: str, step) -> None:
    start = time.perf_counter()
    step()
    logger.info("fleet prepare: %s ready in %.1f s", what, time.perf_counter() - start)


def _tokenizer(config: FleetConfig) -> None:
    from fleet.workers.tokenizer import load_tokenizer

    load_tokenizer(config.model)


def _cpu_kernels() -> None:
    from fleet.kernels.cpu_extension import cpu_kernels

    if cpu_kernels() is None:
        logger.warning("fleet prepare: the CPU kernels cannot be built here; workers use the torch-native kernels")
