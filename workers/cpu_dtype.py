"""What a CPU worker says at start-up about its CPU class: the paths the
class picked, and the cost of bfloat16 on a CPU that only emulates it.

`--dtype auto` avoids that cost (config/engine_args.py); an explicit `--dtype
bfloat16` on such a CPU runs, but says what it costs, measured here on one
matmul of a typical prefill shape.
"""
from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from fleet.config.cpu_class import cpu_class, cpu_computes_bfloat16, cpu_paths
from fleet.config.model import ModelConfig

logger = logging.getLogger(__name__)

PROBE_SHAPE = (256, 576, 1536)
"""tokens x in x out: a 256-token prefill through SmolLM2's MLP."""


def log_cpu_paths(model: ModelConfig) -> None:
    """One line: the class, torch's own capability (which shows that
    FLEET_CPU_ISA reached torch in this process) and each path chosen."""
    paths = cpu_paths(model)
    logger.info(
        "CPU class %s (chosen by %s; the machine is %s), torch capability %s, bfloat16 %s, kernels %s, "
        "GGUF blocks %s (AMX GEMM copy %s), bfloat16 decode copy %s, prefill weights prepacked %s",
        paths["class"], paths["chosen_by"], paths["machine_class"], torch.backends.cpu.get_cpu_capability(),
        paths["bfloat16"], " ".join(paths["kernel_flags"]), paths["gguf_blocks"] or "n/a",
        _yes(paths["gguf_amx_gemm_copy"]), _yes(paths["bfloat16_decode_copy"]),
        _yes(paths["prefill_weights_prepacked"]),
    )


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def warn_if_bfloat16_is_emulated(dtype: torch.dtype) -> None:
    if dtype != torch.bfloat16 or cpu_computes_bfloat16():
        return
    bf16_ms, f32_ms = _matmul_ms(torch.bfloat16), _matmul_ms(torch.float32)
    logger.warning(
        "--dtype bfloat16: this CPU (class %s) has neither AVX512-BF16 nor AMX, so bfloat16 is emulated: "
        "a %dx%dx%d matmul took %.1f ms in bfloat16 and %.1f ms in float32 (%.1fx); "
        "--dtype float32 (what --dtype auto picks here) avoids it", cpu_class().name, *PROBE_SHAPE,
        bf16_ms, f32_ms, bf16_ms / f32_ms,
    )


def _matmul_ms(dtype: torch.dtype, repeats: int = 3) -> float:
    tokens, inputs, outputs = PROBE_SHAPE
    x, w = torch.randn(tokens, inputs, dtype=dtype), torch.randn(outputs, inputs, dtype=dtype)
    F.linear(x, w)  # first call: oneDNN picks and builds its kernel
    start = time.perf_counter()
    for _ in range(repeats):
        F.linear(x, w)
    return (time.perf_counter() - start) / repeats * 1e3
