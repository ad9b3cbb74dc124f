"""The CPU class: one decision, read once, that every CPU dispatch obeys.

A class names what fleet's CPU paths may use, from the lowest to the
highest: `baseline` (no AVX2: plain C++ and torch), `avx2` (AVX2 + FMA:
bfloat16 emulated), `avx512` (F/BW/VL/DQ, bfloat16 still emulated),
`avx512_bf16` (native bfloat16 dot products, e.g. Zen 4) and `amx`
(Sapphire Rapids: AMX tiles for bfloat16). The machine's class is read from
/proc/cpuinfo (not torch, so the launcher stays light); FLEET_CPU_ISA
(config/env.py) lowers it, so that a developer on an AMX machine runs what an
AVX2 user runs: fleet's C++ kernels are compiled for the lower class
(`compiler_flags`), its Python dispatch (`--dtype auto`, the bfloat16 decode
copy, oneDNN prepacking, GGUF blocks) asks `cpu_class()`, and torch and
oneDNN (and MKL) are held to the class through their own environment variables
(`torch_environment`), which `fleet/__init__.py` sets before torch loads in
every fleet process.
"""
from __future__ import annotations

import enum
import functools
from typing import TYPE_CHECKING, Any

from fleet.config import env

if TYPE_CHECKING:
    from fleet.config.model import ModelConfig


class CpuClass(enum.IntEnum):
    """Ordered: a class may use everything the classes below it use."""

    baseline = 0
    avx2 = 1
    avx512 = 2
    avx512_bf16 = 3
    amx = 4


_FLAGS_ADDED = {
    CpuClass.baseline: (),
    CpuClass.avx2: ("avx2", "fma", "f16c"),
    CpuClass.avx512: ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
    CpuClass.avx512_bf16: ("avx512_bf16",),
    CpuClass.amx: ("amx_bf16", "amx_tile"),
}
"""/proc/cpuinfo flags each class needs beyond those of the class below it."""

REQUIRED_FLAGS = {cls: frozenset(flag for lower in CpuClass if lower <= cls for flag in _FLAGS_ADDED[lower])
                  for cls in CpuClass}
"""Every /proc/cpuinfo flag a class needs."""

_MARCH: dict[CpuClass, list[str]] = {
    CpuClass.baseline: ["-march=x86-64"],
    CpuClass.avx2: ["-march=x86-64-v3"],  # AVX2, FMA, F16C, BMI: Haswell, Zen 1-3
    CpuClass.avx512: ["-march=x86-64-v4"],  # + AVX-512 F/BW/VL/DQ/CD: Skylake-X
    CpuClass.avx512_bf16: ["-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"],  # Zen 4, Cooper Lake
}
"""Compiler flags of a class lower than the machine's (its own gets -march=native)."""

_ATEN_CAPABILITY = {CpuClass.baseline: "default", CpuClass.avx2: "avx2"}
"""ATEN_CPU_CAPABILITY of a class: ATen's kernels stop at AVX-512, which every class above avx2 gets."""

_ONEDNN_ISA = {
    CpuClass.baseline: "SSE41",
    CpuClass.avx2: "AVX2",
    CpuClass.avx512: "AVX512_CORE",
    CpuClass.avx512_bf16: "AVX512_CORE_BF16",
    CpuClass.amx: "AVX512_CORE_AMX",
}
"""ONEDNN_MAX_CPU_ISA of a class: the most oneDNN's JIT may emit."""

_MKL_INSTRUCTIONS = {CpuClass.baseline: "SSE4_2", CpuClass.avx2: "AVX2", CpuClass.avx512: "AVX512"}
"""MKL_ENABLE_INSTRUCTIONS of a class (MKL runs torch's float32 GEMMs): the
classes above avx512 add nothing MKL uses for them."""


def machine_cpu_class(flags: frozenset[str] | None = None) -> CpuClass:
    """The highest class whose flags this CPU (or `flags`) has."""
    flags = cpu_flags() if flags is None else flags
    return max(cls for cls, needed in REQUIRED_FLAGS.items() if needed <= flags)


@functools.cache
def cpu_class() -> CpuClass:
    """The class fleet's CPU paths take here: the machine's, or FLEET_CPU_ISA
    when it names a class at or below the machine's (else ValueError, one line
    naming the variable)."""
    machine = machine_cpu_class()
    requested = env.cpu_isa()
    if requested is None:
        return machine
    if requested not in CpuClass.__members__:
        raise ValueError(f"FLEET_CPU_ISA={requested!r} is not a CPU class; "
                         f"choose one of {', '.join(CpuClass.__members__)}")
    chosen = CpuClass[requested]
    if chosen > machine:
        raise ValueError(f"FLEET_CPU_ISA={requested} asks for more than this CPU has (its class is "
                         f"{machine.name}); choose {machine.name} or a class below it")
    return chosen


def cpu_class_is_lowered() -> bool:
    """Whether FLEET_CPU_ISA holds this machine below its own class."""
    return cpu_class() < machine_cpu_class()


def cpu_computes_bfloat16() -> bool:
    """Whether bfloat16 dot products are native (AVX512-BF16 or AMX); below,
    torch and oneDNN emulate them, 3-8x slower than float32."""
    return cpu_class() >= CpuClass.avx512_bf16


def cpu_has_avx512() -> bool:
    """Whether fleet's CPU kernels get their AVX-512 paths."""
    return cpu_class() >= CpuClass.avx512


def compiler_flags() -> list[str]:
    """-march flags for fleet's C++ kernels: the machine's own code for its own
    class, else exactly the lower class's instruction set."""
    if not cpu_class_is_lowered():
        return ["-march=native"]
    return [*_MARCH[cpu_class()], "-mtune=generic"]


def torch_environment() -> dict[str, str]:
    """Environment variables that hold torch (ATen's vectorised kernels), oneDNN
    and MKL to the class; empty when fleet runs at the machine's own class."""
    if not cpu_class_is_lowered():
        return {}
    settings = {"ONEDNN_MAX_CPU_ISA": _ONEDNN_ISA[cpu_class()]}
    settings["ATEN_CPU_CAPABILITY"] = _ATEN_CAPABILITY.get(cpu_class(), "avx512")
    if cpu_class() in _MKL_INSTRUCTIONS:
        settings["MKL_ENABLE_INSTRUCTIONS"] = _MKL_INSTRUCTIONS[cpu_class()]
    return settings


def cpu_paths(model: ModelConfig) -> dict[str, Any]:
    """What the class picks for `model` on a CPU worker: `fleet plan` shows it
    and each worker logs it (with torch's own capability) at start-up."""
    return {
        "class": cpu_class().name,
        "machine_class": machine_cpu_class().name,
        "chosen_by": "FLEET_CPU_ISA" if env.cpu_isa() else "the machine",
        "bfloat16": "native" if cpu_computes_bfloat16() else "emulated",
        "kernel_flags": compiler_flags(),
        "torch_environment": torch_environment(),
        "gguf_blocks": ("kept" if model.keeps_gguf_blocks("cpu") else "dequantized") if model.is_gguf else None,
        "bfloat16_decode_copy": model.keeps_bfloat16_decode_weights("cpu"),
        "prefill_weights_prepacked": model.prepacks_prefill_weights("cpu"),
        "gguf_amx_gemm_copy": model.keeps_amx_gemm_copies("cpu") if model.is_gguf else None,
    }


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags, read from /proc/cpuinfo; a system without it (not Linux) has none."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return frozenset(next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def classes_below_this_machine() -> list[CpuClass]:
    """The classes FLEET_CPU_ISA can emulate here, down to avx2 (what `make
    test` runs the kernel, model and engine tests again under), highest first."""
    return [cls for cls in reversed(CpuClass) if CpuClass.avx2 <= cls < machine_cpu_class()]

