"""C++ CPU kernels (`kernels/csrc/`), built as a torch extension at install
(`make install` runs `fleet prepare`), or on first use where no build fits
this machine (another CPU, torch or source).

`cpu_kernels()` returns their op namespace, `torch.ops.fleet_cpu`, or None
(after one warning) when they cannot be built here: no compiler, no ninja, a
compile error. Callers then use the torch-native path.

Builds live where torch keeps JIT extensions (TORCH_EXTENSIONS_DIR, default
~/.cache/torch_extensions/py<ver>_<accel>/<name>/). The name carries a digest
of the source, the flags, the torch version and this CPU's features
(-march=native code must not run on another CPU sharing the same home
directory). The -march flags are the CPU class's (config/cpu_class.py): the
machine's own, or a lower class's instruction set under FLEET_CPU_ISA, so the
`#if defined(__AVX512F__)` paths compiled in are the class's. A built library
is current by construction: a later process imports it directly, without asking ninja. Concurrent builders are serialised
by an flock the kernel releases if its holder dies; torch's own lock file,
which a killed builder would leave behind for everyone to wait on forever, is
cleared under it.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import platform
import threading
import time
from pathlib import Path

import torch

from fleet.config.cpu_class import compiler_flags, cpu_flags

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name for name in (
    "paged_attention_cpu.cpp", "elementwise_cpu.cpp", "linear_bf16_weight_cpu.cpp", "rotary_cache_cpu.cpp",
    "gguf_linear_cpu.cpp", "gguf_kquant_cpu.cpp", "gguf_kquant_integer_cpu.cpp",
)]
_CFLAGS = ["-O3", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_ops: torch._ops._OpNamespace | None = None
_failed = False


def cpu_kernels() -> torch._ops._OpNamespace | None:
    """`torch.ops.fleet_cpu` once the library is loaded (built first if needed), or None if it cannot be."""
    global _ops, _failed
    if _ops is not None or _failed:
        return _ops
    with _lock:
        if _ops is None and not _failed:
            try:
                _load()
                _ops = torch.ops.fleet_cpu
            except Exception as exc:  # no compiler, no ninja, compile error: fall back
                _failed = True
                logger.warning("CPU kernels unavailable, using the torch-native path: %s", exc)
    return _ops


def _load() -> None:
    from torch.utils.cpp_extension import _get_build_directory, load

    name = f"fleet_cpu_kernels_{_fingerprint()}"
    build_dir = Path(_get_build_directory(name, verbose=False))  # creates it
    library = build_dir / f"{name}.so"
    start = time.perf_counter()
    flock_path = build_dir / "fleet.flock"
    with open(flock_path, "w") as flock:
        fcntl.flock(flock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        how = "loaded"
        if library.exists():
            try:
                torch.ops.load_library(str(library))
            except OSError as exc:  # e.g. truncated by a builder killed while linking
                logger.warning("rebuilding %s, which does not load: %s", library, exc)
                library.unlink()
        if not library.exists():
            # Every live builder holds the flock, so a torch lock file seen here was left by a dead one.
            (build_dir / "lock").unlink(missing_ok=True)
            try:
                load(  # builds, then loads the library: its ops register themselves
                    name=name,
                    sources=[str(s) for s in _SOURCES],
                    extra_cflags=[*_CFLAGS, *compiler_flags()],
                    extra_ldflags=_LDFLAGS,
                    build_directory=str(build_dir),
                    verbose=False,
                    is_python_module=False,
                )
            except Exception:
                # Leave no half-built object (from a builder killed mid-compile) for the next try.
                for leftover in build_dir.iterdir():
                    if leftover.name != flock_path.name and leftover.is_file():
                        leftover.unlink()
                raise
            how = "built"
    logger.info("CPU kernels %s in %.2f s (%s)", how, time.perf_counter() - start, library)


def _fingerprint() -> str:
    """Digest of everything the built library depends on."""
    digest = hashlib.sha256()
    for source in [*_SOURCES, *sorted(_SOURCES[0].parent.glob("*.h"))]:
        digest.update(source.read_bytes())
    cpu = " ".join(sorted(cpu_flags())) or platform.processor()  # -march=native code is this CPU's
    parts = [*_CFLAGS, *compiler_flags(), *_LDFLAGS, torch.__version__, platform.python_version(),
             platform.machine(), cpu]
    digest.update("\0".join(parts).encode())
    return digest.hexdigest()[:12]

