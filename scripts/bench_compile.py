"""The decode forward, eager against --compilation-config mode torch_compile,
in one process: compile time, then ms per step at each batch size, the two
interleaved round by round (so that load from other processes hits both).

    python -P scripts/bench_compile.py [--batch-sizes 1 8 32] [--context 256] [--rounds 10] [-- launch flags]

The model is the default one unless the launch flags say otherwise; the KV
cache holds each sequence's context (random values) in shuffled blocks. The
whole-server comparison is `fleet bench serve` against two launches.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from fleet.config.cli_args import parse_engine_args
from fleet.frontend.cli import launch_parser
from fleet.kernels.attention import AttentionMetadata
from fleet.workers.compiled_decode import CompiledDecode
from fleet.workers.loader import load_model
from fleet.workers.model_runner import TORCH_DTYPES


def decode_step(size: int, context: int, block_size: int, num_blocks: int, vocab: int):
    """`size` sequences of `context` tokens each, one new token each."""
    blocks_each = -(-context // block_size)
    blocks = random.Random(size).sample(range(num_blocks), size * blocks_each)
    tables = [blocks[i * blocks_each : (i + 1) * blocks_each] for i in range(size)]
    meta = AttentionMetadata.build([1] * size, [context] * size, tables, block_size)
    return torch.randint(3, vocab, (size,)), torch.full((size,), context - 1), meta


def ms_per_step(forward, step, kv_caches, repeats: int) -> float:
    forward(*step[:2], kv_caches, step[2])
    start = time.perf_counter()
    for _ in range(repeats):
        forward(*step[:2], kv_caches, step[2])
    return (time.perf_counter() - start) / repeats * 1000


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=256, help="tokens of each sequence")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=10, help="steps timed per round")
    args, launch_flags = parser.parse_known_args()
    launch_flags = [flag for flag in launch_flags if flag != "--"]
    max_batch = str(max(args.batch_sizes))
    _, engine_args = parse_engine_args(launch_parser("launch"), [*launch_flags, "--max-num-seqs", max_batch,
                                                         "--compilation-config.mode", "torch_compile",
                                                         "--compilation-config.max_batch_size", max_batch,
                                                         "--compilation-config.batch_sizes", "[]"])
    config = engine_args.create_config()
    dtype = TORCH_DTYPES[config.model.dtype]
    model = load_model(config.model, config.load, dtype, torch.device("cpu"))
    block_size = config.cache.block_size
    num_blocks = max(args.batch_sizes) * -(-args.context // block_size)
    shape = (2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
    kv_caches = [torch.randn(shape).to(dtype) for _ in range(model.num_layers)]
    compiled = CompiledDecode(config, model, torch.device("cpu"))
    vocab = config.model.hf_config["vocab_size"]
    print(f"{config.model.model} ({config.model.dtype}), {torch.get_num_threads()} threads, context {args.context}")
    steps = {}
    for size in args.batch_sizes:
        steps[size] = decode_step(size, args.context, block_size, num_blocks, vocab)
        start = time.perf_counter()
        compiled(*steps[size][:2], kv_caches, steps[size][2])
        print(f"batch {size:>3}: first compiled call {time.perf_counter() - start:.1f} s")
    for size, step in steps.items():
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.rounds):
            times["eager"].append(ms_per_step(model, step, kv_caches, args.repeats))
            times["compiled"].append(ms_per_step(compiled, step, kv_caches, args.repeats))
        eager, ours = statistics.median(times["eager"]), statistics.median(times["compiled"])
        print(f"batch {size:>3}: eager {eager:6.2f} ms (min {min(times['eager']):.2f}), compiled {ours:6.2f} ms "
              f"(min {min(times['compiled']):.2f}): {eager / ours:.3f}x")


if __name__ == "__main__":
    main()
