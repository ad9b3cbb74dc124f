"""The linear layers' matmul on this CPU: the library GEMM (F.linear: MKL
for float32, oneDNN for bfloat16) against the packed bfloat16 weight copy
that decode steps use (kernels/linear.py), for SmolLM2-135M's shapes and 1
to 128 rows, with the activations of a float32 model and of a bfloat16 one.

    python -P scripts/bench_linear.py [--threads 2] [--dtype float32 bfloat16]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from fleet.kernels.cpu_extension import cpu_kernels
from fleet.kernels.linear import PREFILL_ROWS_HINT, pack_bfloat16

SHAPES = {"qkv": (960, 576), "gate_up": (3072, 576), "down": (576, 1536), "o": (576, 576), "lm_head": (49152, 576)}


def milliseconds(fn, repeats: int = 50) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_kernels()
    if ops is None:
        raise SystemExit("the CPU kernels cannot be built here")
    print(f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} threads")
    for dtype in (getattr(torch, name) for name in args.dtype):
        for name, (out_features, in_features) in SHAPES.items():
            weight = torch.randn(out_features, in_features).to(dtype)
            copy = pack_bfloat16(weight)
            # What steps above DECODE_ROWS use for a bfloat16 model (kernels/linear.py).
            prepacked = (torch.ops.mkldnn._reorder_linear_weight(weight, PREFILL_ROWS_HINT)
                         if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available() else None)
            for rows in (1, 2, 4, 8, 16, 32, 64, 128):
                x = torch.randn(rows, in_features, dtype=dtype)
                library = milliseconds(lambda x=x, weight=weight: F.linear(x, weight))
                packed = milliseconds(lambda x=x, copy=copy, n=out_features: ops.linear_bf16_weight(x, copy, n, None))
                line = (f"{str(dtype)[6:]:8s} {name:8s} {out_features:5d}x{in_features:4d} rows {rows:3d}: "
                        f"F.linear {library:7.3f} ms   bf16 copy {packed:7.3f} ms   ({library / packed:4.2f}x)")
                if prepacked is not None:
                    onednn = milliseconds(lambda x=x, w=prepacked: torch.ops.mkldnn._linear_pointwise(
                        x, w, None, "none", [], ""))
                    line += f"   oneDNN prepacked {onednn:7.3f} ms   ({onednn / packed:4.2f}x)"
                print(line)


if __name__ == "__main__":
    main()
