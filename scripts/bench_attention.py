"""Paged attention on the CPU: the fused C++ kernel against the torch-native path.

1. attention per layer: `paged_attention` for a decode batch (default 64
   sequences x 320 tokens of context) with the default model's shapes
   (SmolLM2-135M: 9 query heads, 3 KV heads, head_dim 64, bf16), one KV cache
   per layer as in the model, so the KV is read from memory, not from cache;
2. prefill attention per layer: one whole prompt of each --prefill-lengths
   (the fused kernel's tiles of query tokens, against causal SDPA);
3. a whole model step (forward + logits) of the default model with dummy
   weights, for that decode batch and for a prefill batch.

    python scripts/bench_attention.py [--batch 64] [--context 320] [--threads 2] [--shuffle-blocks]
                                      [--prefill-lengths 256 2048]
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import time
from collections.abc import Callable

import torch

from fleet.config import EngineArgs
from fleet.kernels.attention import AttentionMetadata, paged_attention, set_cpu_kernels_enabled
from fleet.kernels.cpu_extension import cpu_kernels
from fleet.workers.loader import load_model

PATHS = {"fused": True, "torch": False}


def best_ms(fn: Callable[[], object], repeats: int, rounds: int = 5) -> float:
    """Best of `rounds` means over `repeats` calls, in ms (noise on a shared machine only adds)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - start) / repeats)
    return best * 1e3


def block_tables(seq_lens: list[int], block_size: int, shuffle: bool) -> tuple[list[list[int]], int]:
    needed = [-(-n // block_size) for n in seq_lens]
    ids = list(range(1, sum(needed) + 1))
    if shuffle:
        random.Random(0).shuffle(ids)
    tables, start = [], 0
    for count in needed:
        tables.append(ids[start : start + count])
        start += count
    return tables, sum(needed) + 1


def bench_layer(args, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    dtype, bs = torch.bfloat16, args.block_size
    seq_lens = [args.context] * args.batch
    tables, num_blocks = block_tables(seq_lens, bs, args.shuffle_blocks)
    meta = AttentionMetadata.build([1] * args.batch, seq_lens, tables, bs)
    caches = [torch.randn(2, num_blocks, bs, num_kv_heads, head_dim).to(dtype) for _ in range(num_layers)]
    q = torch.randn(args.batch, num_heads, head_dim).to(dtype)
    k = torch.randn(args.batch, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(args.batch, num_kv_heads, head_dim).to(dtype)
    kv_mb = args.batch * -(-args.context // bs) * bs * num_kv_heads * head_dim * 2 * 2 / 1e6
    print(f"decode attention per layer: batch {args.batch} x context {args.context}, {num_heads} heads / "
          f"{num_kv_heads} kv heads x {head_dim}, bf16, block size {bs}, {kv_mb:.1f} MB of KV per layer")
    for path, enabled in PATHS.items():
        set_cpu_kernels_enabled(enabled)

        def all_layers() -> None:
            for cache in caches:
                paged_attention(q, k, v, cache, meta, head_dim**-0.5)

        ms = best_ms(all_layers, repeats=2) / num_layers
        print(f"  {path:6s} {ms:7.3f} ms/layer  ({kv_mb / ms:5.1f} GB/s of KV)")


def bench_prefill_layer(args, num_heads: int, num_kv_heads: int, head_dim: int, length: int) -> None:
    dtype, bs = torch.bfloat16, args.block_size
    tables, num_blocks = block_tables([length], bs, args.shuffle_blocks)
    meta = AttentionMetadata.build([length], [length], tables, bs)
    cache = torch.randn(2, num_blocks, bs, num_kv_heads, head_dim).to(dtype)
    q = torch.randn(length, num_heads, head_dim).to(dtype)
    k = torch.randn(length, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(length, num_kv_heads, head_dim).to(dtype)
    # Causal: each of the H heads scores and sums half the length^2 pairs.
    gflop = 2 * 2 * num_heads * head_dim * length * (length + 1) / 2 / 1e9
    print(f"prefill attention per layer: one prompt of {length} tokens, bf16")
    for path, enabled in PATHS.items():
        set_cpu_kernels_enabled(enabled)
        ms = best_ms(lambda: paged_attention(q, k, v, cache, meta, head_dim**-0.5), repeats=2 if length > 512 else 10)
        print(f"  {path:6s} {ms:8.2f} ms/layer  ({gflop / ms * 1e3:6.1f} GFLOP/s)")


def bench_step(args, model, label: str, query_lens: list[int], seq_lens: list[int]) -> None:
    bs = args.block_size
    tables, num_blocks = block_tables(seq_lens, bs, args.shuffle_blocks)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs)
    kv = [torch.zeros(2, num_blocks, bs, model.num_kv_heads, model.head_dim, dtype=torch.bfloat16)
          for _ in range(model.num_layers)]
    num_tokens = sum(query_lens)
    ids = torch.randint(0, 10_000, (num_tokens,))
    positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens, strict=True)])
    print(f"model step, {label}: {num_tokens} tokens")
    for path, enabled in PATHS.items():
        set_cpu_kernels_enabled(enabled)

        def step() -> None:
            model.compute_logits(model(ids, positions, kv, meta))

        ms = best_ms(step, repeats=3 if num_tokens <= 256 else 1, rounds=3)
        print(f"  {path:6s} {ms:8.1f} ms/step  ({num_tokens / ms * 1e3:7.0f} tok/s)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--shuffle-blocks", action="store_true", help="scatter each sequence's blocks")
    parser.add_argument("--prefill-lengths", type=int, nargs="*", default=[256, 2048])
    parser.add_argument("--prefill", type=str, default="4x256", help="prefill batch: SEQS x TOKENS ('' to skip)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    start = time.perf_counter()
    if cpu_kernels() is None:
        raise SystemExit("the CPU kernel extension could not be built: nothing to compare")
    print(f"CPU kernels ready in {time.perf_counter() - start:.2f} s; {torch.get_num_threads()} threads")

    config = EngineArgs(device="cpu").create_config()
    load = dataclasses.replace(config.load, load_format="dummy")
    model = load_model(config.model, load, torch.bfloat16, torch.device("cpu"))
    num_heads = next(iter(model.model.layers.values())).self_attn.num_heads
    with torch.inference_mode():
        bench_layer(args, model.num_layers, num_heads, model.num_kv_heads, model.head_dim)
        for length in args.prefill_lengths:
            bench_prefill_layer(args, num_heads, model.num_kv_heads, model.head_dim, length)
        bench_step(args, model, f"decode {args.batch} x context {args.context}",
                   [1] * args.batch, [args.context] * args.batch)
        if args.prefill:
            seqs, tokens = (int(x) for x in args.prefill.split("x"))
            bench_step(args, model, f"prefill {seqs} x {tokens}", [tokens] * seqs, [tokens] * seqs)


if __name__ == "__main__":
    main()
