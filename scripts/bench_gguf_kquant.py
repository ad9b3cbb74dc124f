"""K-quant linears multiplied in their super-blocks (csrc/gguf_kquant_cpu.cpp)
by both paths: the integers of x rounded to Q8_K, and the float32 tiles, for
a 1B Llama's shapes (hidden 2048, MLP 8192, 16 layers, as a Q4_K_M file
holds it: Q4_K with Q6_K in some tensors, the head Q6_K; --types times
others, Q2_K, Q3_K and IQ4_XS among them, in every shape). Each line gives ms
per call and the weight bytes read per second, per type, number of rows and
threads; quantized_linear takes the integer path up to KQUANT_INTEGER_ROWS rows.

    python -P scripts/bench_gguf_kquant.py [--threads 1 2] [--rows 1 2 4 8 16 32 128] [--shapes qkv down]
    FLEET_CPU_ISA=avx2 python -P scripts/bench_gguf_kquant.py --types Q4_K
    python -P scripts/bench_gguf_kquant.py --shapes down --threads 1 --types Q2_K Q3_K IQ4_XS
"""
from __future__ import annotations

import argparse
import time
from functools import partial

import gguf
import numpy as np
import torch

from fleet.kernels.cpu_extension import cpu_kernels
from fleet.kernels.quantized import KEPT_TYPES

# name -> (out features, in features, types timed unless --types says otherwise)
SHAPES = {"qkv": (3072, 2048, ("Q4_K", "Q5_K", "Q6_K")), "o": (2048, 2048, ("Q4_K", "Q5_K", "Q6_K")),
          "gate_up": (16384, 2048, ("Q4_K", "Q5_K", "Q6_K")), "down": (2048, 8192, ("Q4_K", "Q5_K", "Q6_K")),
          "head": (49152, 2048, ("Q6_K",))}
SCALE_OFFSETS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_XS": (0,)}
"""Where each type's float16 d (and dmin) sit in its super-block."""
CACHE_BYTES = 96 << 20
"""Weights cycled through per shape: more than the caches hold, as a forward's layers are."""


def random_blocks(kind: str, rows: int, columns: int, rng: np.random.Generator) -> torch.Tensor:
    """Valid super-blocks (every byte pattern of the quants and scales is) with weights of order 1."""
    blocks = rng.integers(0, 256, (rows, columns // 256, KEPT_TYPES[gguf.GGMLQuantizationType[kind]].nbytes),
                          dtype=np.uint8)
    for offset in SCALE_OFFSETS[kind]:
        scale = rng.uniform(2e-4, 1e-3, (rows, columns // 256, 1)).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8)
    return torch.from_numpy(blocks.reshape(rows, -1))


def milliseconds(calls, budget_s: float = 0.25) -> float:
    """Mean ms of the calls, run in turn (each weight from memory, not from the cache the last call left)."""
    for call in calls:
        call()
    count, start = 0, time.perf_counter()
    while count < 3 * len(calls) or time.perf_counter() - start < budget_s:
        calls[count % len(calls)]()
        count += 1
    return (time.perf_counter() - start) / count * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16, 32, 128])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--types", nargs="+", choices=list(SCALE_OFFSETS), help="types for every shape")
    parser.add_argument("--paths", nargs="+", default=["integer", "float"], choices=["integer", "float"])
    args = parser.parse_args()
    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("the CPU kernels cannot be built here")
    rng = np.random.default_rng(0)
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}; ms per call, weight GB/s")
    for name in args.shapes:
        out_features, in_features, default_types = SHAPES[name]
        for kind in args.types or default_types:
            gguf_type = int(gguf.GGMLQuantizationType[kind])
            nbytes = out_features * in_features // 256 * KEPT_TYPES[gguf_type].nbytes
            weights = [random_blocks(kind, out_features, in_features, rng) for _ in range(-(-CACHE_BYTES // nbytes))]
            for threads in args.threads:
                torch.set_num_threads(threads)
                for rows in args.rows:
                    x = torch.randn(rows, in_features)
                    line = f"{name:7s} {out_features:5d}x{in_features:4d} {kind} threads {threads} rows {rows:3d}:"
                    for path in args.paths:
                        calls = [partial(ops.gguf_kquant_linear_by, x, w, gguf_type, out_features, None,
                                         path == "integer") for w in weights]
                        ms = milliseconds(calls)
                        line += f"   {path} {ms:8.3f} ms {nbytes / ms / 1e6:5.1f} GB/s"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
