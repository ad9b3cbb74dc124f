"""malloc's heap in a CPU worker, where activations live.

Batches of changing shapes leave holes in glibc's heap, and glibc raises its
mmap and trim thresholds (to 32 and 64 MiB) each time a large block is freed,
after which the heap keeps whatever peak the shapes reached: over a 5-minute
soak (scripts/soak.py) a worker's RSS grew 12-20 % with nothing leaking. A
fixed mmap threshold (the value the dynamic one climbs to) keeps the trim
threshold at 128 KiB, and a trim when the worker goes idle hands the holes
back; at rest the worker then stays within 3 % of its baseline, at no
throughput cost measured (scripts/bench_offline.py; a 1 MiB threshold cost
16 %). Other C libraries (musl, macOS) are left as they are.
"""
from __future__ import annotations

import ctypes
import functools

from fleet.config import env

MMAP_THRESHOLD_BYTES = 32 * 2**20
M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def fix_mmap_threshold() -> None:
    """Once, at start-up; MALLOC_MMAP_THRESHOLD_ in the environment (the user's own tuning) wins."""
    libc = _glibc()
    if libc is not None and not env.malloc_mmap_threshold_set():
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)


def return_free_pages() -> None:
    """Hand the free pages inside the heap back to the kernel (a few milliseconds)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
