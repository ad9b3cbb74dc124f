"""The CPU class (config/cpu_class.py): read from the CPU's flags, lowered by
FLEET_CPU_ISA, refused above the machine's, and obeyed by torch in a fresh
process and by each dispatch decision."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from fleet.config import cpu_class as cc
from fleet.config.cpu_class import CpuClass
from fleet.config.model import ModelConfig

AVX2_EPYC = frozenset("fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi1 bmi2".split())
ZEN4 = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
SKYLAKE_X = AVX2_EPYC | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
SAPPHIRE_RAPIDS = ZEN4 | {"amx_bf16", "amx_tile", "amx_int8", "avx_vnni"}


@pytest.fixture
def machine(monkeypatch):
    """Pretend the CPU has the given flags (and FLEET_CPU_ISA the given value)."""
    def pretend(flags: frozenset[str], isa: str | None = None) -> None:
        monkeypatch.setattr(cc, "cpu_flags", lambda: flags)
        if isa is None:
            monkeypatch.delenv("FLEET_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("FLEET_CPU_ISA", isa)
        cc.cpu_class.cache_clear()

    yield pretend
    cc.cpu_class.cache_clear()


@pytest.mark.parametrize("flags,expected", [
    (frozenset({"sse2", "avx"}), CpuClass.baseline), (AVX2_EPYC, CpuClass.avx2), (SKYLAKE_X, CpuClass.avx512),
    (ZEN4, CpuClass.avx512_bf16), (SAPPHIRE_RAPIDS, CpuClass.amx),
])
def test_the_machine_class_comes_from_its_flags(flags, expected):
    assert cc.machine_cpu_class(flags) == expected


def test_this_machine_agrees_with_torch():
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert (cc.machine_cpu_class() >= CpuClass.avx512_bf16) == native


def test_the_override_lowers_the_class_and_every_decision(machine):
    machine(SAPPHIRE_RAPIDS)
    assert cc.cpu_class() == CpuClass.amx and cc.compiler_flags() == ["-march=native"]
    assert cc.torch_environment() == {} and cc.cpu_computes_bfloat16()
    machine(SAPPHIRE_RAPIDS, "avx2")
    assert cc.cpu_class() == CpuClass.avx2 and cc.cpu_class_is_lowered()
    assert cc.compiler_flags() == ["-march=x86-64-v3", "-mtune=generic"]
    assert cc.torch_environment() == {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                                      "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert not cc.cpu_computes_bfloat16() and not cc.cpu_has_avx512()
    machine(SAPPHIRE_RAPIDS, "avx512_bf16")
    assert cc.torch_environment() == {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "ATEN_CPU_CAPABILITY": "avx512"}
    assert cc.cpu_computes_bfloat16() and "-mavx512bf16" in cc.compiler_flags()


def test_dispatch_follows_the_class(machine):
    gguf = ModelConfig(model_path="m.gguf", dtype="bfloat16", hf_config={"dtype": "bfloat16"})
    for isa, decode_copy, prepacked, blocks, amx_copy in [
        ("amx", True, True, "kept", True), ("avx512_bf16", True, True, "kept", False),
        ("avx512", True, False, "kept", False), ("avx2", False, False, "kept", False),
        ("baseline", False, False, "dequantized", False),
    ]:
        machine(SAPPHIRE_RAPIDS, isa)
        paths = cc.cpu_paths(gguf)
        assert paths["class"] == isa and paths["bfloat16"] == ("native" if prepacked else "emulated")
        assert paths["gguf_blocks"] == blocks and paths["gguf_amx_gemm_copy"] == amx_copy, isa
        assert (paths["bfloat16_decode_copy"], paths["prefill_weights_prepacked"]) == (decode_copy, prepacked), isa


@pytest.mark.parametrize("isa,says", [("avx512", "asks for more than this CPU has (its class is avx2)"),
                                      ("sse9", "is not a CPU class; choose one of baseline, avx2")])
def test_a_class_the_machine_lacks_is_refused_naming_the_variable(machine, isa, says):
    machine(AVX2_EPYC, isa)
    with pytest.raises(ValueError, match=f"^FLEET_CPU_ISA=.*{re.escape(says)}"):
        cc.cpu_class()


def test_fleet_plan_refuses_a_bad_class_in_one_line():
    result = subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", "plan"], capture_output=True,
                            text=True, env={**_environment(), "FLEET_CPU_ISA": "avx1024"}, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("fleet plan: error: FLEET_CPU_ISA='avx1024'")


@pytest.mark.parametrize("isa,capability", [("avx2", "AVX2"), ("baseline", "DEFAULT")])
def test_the_override_holds_torch_and_shows_in_the_plan(isa, capability):
    """A fresh process under FLEET_CPU_ISA: torch's own dispatch is the
    class's (fleet sets ATEN_CPU_CAPABILITY before torch loads), and `fleet
    plan` shows the class and the paths it picked."""
    probe = "import fleet, torch; print(torch.backends.cpu.get_cpu_capability())"
    env = {**_environment(), "FLEET_CPU_ISA": isa}
    assert subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, env=env,
                          check=True, timeout=120).stdout.strip() == capability
    plan = subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", "plan", "--dtype", "bfloat16"],
                          capture_output=True, text=True, env=env, check=True, timeout=120).stdout
    cpu = json.loads(plan)["cpu"]
    assert cpu["class"] == isa and cpu["chosen_by"] == "FLEET_CPU_ISA" and cpu["bfloat16"] == "emulated"
    assert not cpu["bfloat16_decode_copy"] and not cpu["prefill_weights_prepacked"]


def _environment() -> dict[str, str]:
    held = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
    return {key: value for key, value in os.environ.items() if key not in held}


def test_make_test_runs_again_under_each_class_below_the_machines(machine):
    machine(SAPPHIRE_RAPIDS)
    assert cc.classes_below_this_machine() == [CpuClass.avx512_bf16, CpuClass.avx512, CpuClass.avx2]
    machine(ZEN4)
    assert cc.classes_below_this_machine() == [CpuClass.avx512, CpuClass.avx2]
    machine(AVX2_EPYC)
    assert cc.classes_below_this_machine() == []
