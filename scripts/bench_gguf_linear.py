"""GGUF weights multiplied in their blocks (csrc/gguf_linear_cpu.cpp) against
the same weights dequantized, as fleet multiplied them before
(kernels/linear.py: the packed bfloat16 copy up to decode_rows() rows, oneDNN's
prepacked GEMM, where bfloat16 is native, or F.linear above), for SmolLM2-135M's shapes: its layers are
Q4_1, its tied embedding / LM head Q8_0. Each line also times float32
F.linear on the dequantized weight (what a float32 model without kept blocks
runs at every step). The last lines add a whole forward's matmuls up (30
layers and the head) per number of rows, when --shapes names them all.

    python -P scripts/bench_gguf_linear.py [--threads 2] [--dtype bfloat16 float32] [--rows 1 8 32 256]
    FLEET_CPU_ISA=avx2 python -P scripts/bench_gguf_linear.py --dtype float32 --shapes up down --rows 1 4 32 128
"""
from __future__ import annotations

import argparse
import time
from collections import defaultdict
from functools import partial

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.kernels.cpu_extension import cpu_kernels
from fleet.kernels.linear import PREFILL_ROWS_HINT, decode_rows, pack_bfloat16

# name -> (out features, in features, GGUF type, times per forward)
SHAPES = {"qkv": (960, 576, "Q4_1", 30), "o": (576, 576, "Q4_1", 30), "gate_up": (3072, 576, "Q4_1", 30),
          "down": (576, 1536, "Q4_1", 30), "lm_head": (49152, 576, "Q8_0", 1)}
FORWARD = list(SHAPES)
SHAPES["up"] = (1536, 576, "Q4_1", 30)  # half of gate_up: 576 -> 1536, the pair of down


def milliseconds(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def dequantized_linear(weight: torch.Tensor, rows: int, ops):
    """What a dequantized model ran for a step of `rows` rows: x -> y."""
    if rows <= decode_rows():
        copy = pack_bfloat16(weight)
        return lambda x: ops.linear_bf16_weight(x, copy, weight.shape[0], None)
    if weight.dtype == torch.bfloat16 and cpu_computes_bfloat16() and torch.backends.mkldnn.is_available():
        prepacked = torch.ops.mkldnn._reorder_linear_weight(weight, PREFILL_ROWS_HINT)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], "")
    return lambda x: F.linear(x, weight)


def cycling(calls):
    """One call after the other, as the layers of a forward run: each weight
    comes from memory, not from the cache the previous call left it in."""
    state = {"i": 0}

    def step():
        calls[state["i"] % len(calls)]()
        state["i"] += 1
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8, 16, 32, 48, 64, 256])
    parser.add_argument("--shapes", nargs="+", default=FORWARD, choices=list(SHAPES),
                        help="layers to time (default: a forward's, which the totals add up)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("the CPU kernels cannot be built here")
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    for dtype in (getattr(torch, name) for name in args.dtype):
        totals: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name in args.shapes:
            out_features, in_features, kind, count = SHAPES[name]
            gguf_type = gguf.GGMLQuantizationType[kind]
            # As many distinct weights as the model has: 30 layers' worth is
            # more than the caches hold, as in a forward.
            blocks = [ops.gguf_pack(torch.from_numpy(gguf.quants.quantize(
                np.random.randn(out_features, in_features).astype(np.float32), gguf_type)), int(gguf_type), in_features)
                for _ in range(count)]
            weights = [ops.gguf_rows(b, int(gguf_type), in_features, torch.arange(out_features), dtype)
                       for b in blocks]
            for rows in args.rows:
                x = torch.randn(rows, in_features).to(dtype)
                repeats = count * max(1, min(20, 400 // rows // count + 1))
                kept = cycling([partial(ops.gguf_linear, x, b, int(gguf_type), out_features, None) for b in blocks])
                before = cycling([partial(dequantized_linear(w, rows, ops), x) for w in weights])
                x32 = x.float()
                float32 = cycling([partial(F.linear, x32, w.float()) for w in weights])
                kept_ms, before_ms = milliseconds(kept, repeats), milliseconds(before, repeats)
                float32_ms = milliseconds(float32, repeats)
                totals[rows][0] += kept_ms * count
                totals[rows][1] += before_ms * count
                print(f"{str(dtype)[6:]:8s} {name:8s} {kind} {out_features:5d}x{in_features:4d} rows {rows:3d}: "
                      f"blocks {kept_ms:7.3f} ms   dequantized {before_ms:7.3f} ms   ({before_ms / kept_ms:4.2f}x)   "
                      f"float32 F.linear {float32_ms:7.3f} ms   ({float32_ms / kept_ms:4.2f}x)")
        if not set(FORWARD) <= set(args.shapes):
            continue
        for rows, (kept, before) in sorted(totals.items()):
            print(f"{str(dtype)[6:]:8s} whole forward rows {rows:3d}: blocks {kept:7.2f} ms   "
                  f"dequantized {before:7.2f} ms   ({before / kept:4.2f}x)")


if __name__ == "__main__":
    main()
