"""Prefill/decode disaggregation against ordinary replicas (issue 29 b).

    python -P scripts/bench_disaggregation.py [--duration 90] [--long-prompt 2000] [--decoders 4]
                                              [--output-len 128] [--long-every 4] [--launch-args "..."]

Runs the same mixed workload twice on the default model:
  - `fleet launch --dp 2` (two ordinary replicas, least-loaded routing), and
  - `fleet launch --disaggregate prefill=1,decode=1` (one replica computes
    prompts, the other pulls their KV and decodes).
Workload: --decoders streaming clients in a loop, each a short prompt and
--output-len tokens (long outputs), plus one long prompt of --long-prompt
tokens with 8 output tokens every --long-every seconds. Prints, per setup:
TPOT p50/p99 of the long outputs (what a long prefill stalls), TTFT p50/p99
of the long prompts and of the long outputs, requests completed. One run each.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import threading
import time

import httpx

from fleet.frontend.launched_server import LaunchedServer

BASE = ["--kv-cache-memory-bytes", "512M", "--max-model-len", "4096"]
WORDS = "the of and to in is was for on that with as by at from his her this which are be an it had not".split()


def stream(url: str, prompt: str, max_tokens: int) -> tuple[float | None, list[float]]:
    """(TTFT, the gaps between tokens) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    start = last = time.monotonic()
    ttft, gaps = None, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            if not json.loads(line[6:])["choices"][0]["text"]:
                continue
            now = time.monotonic()
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
    return ttft, gaps


def run_workload(url: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    stop = threading.Event()
    decode_ttfts: list[float] = []
    tpots: list[float] = []
    long_ttfts: list[float] = []
    errors: list[str] = []

    def decoder() -> None:
        while not stop.is_set():
            try:
                ttft, gaps = stream(url, " ".join(rng.choices(WORDS, k=32)), args.output_len)
                decode_ttfts.append(ttft)
                tpots.extend(gaps)
            except httpx.HTTPError as error:
                errors.append(str(error))

    def long_prompts() -> None:
        threads = []
        while not stop.wait(args.long_every):
            prompt = " ".join(rng.choices(WORDS, k=args.long_prompt))

            def one(prompt: str = prompt) -> None:
                try:
                    long_ttfts.append(stream(url, prompt, 8)[0])
                except httpx.HTTPError as error:
                    errors.append(str(error))

            thread = threading.Thread(target=one)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()

    workers = [threading.Thread(target=decoder) for _ in range(args.decoders)] + [threading.Thread(target=long_prompts)]
    for worker in workers:
        worker.start()
    time.sleep(args.duration)
    stop.set()
    for worker in workers:
        worker.join()
    return {"tpot": tpots, "decode_ttft": decode_ttfts, "long_ttft": long_ttfts, "errors": errors}


def ms(values: list[float]) -> str:
    if len(values) < 2:
        return f"n={len(values)}"
    p50, p99 = statistics.median(values), statistics.quantiles(values, n=100)[98]
    return f"p50 {p50 * 1000:.0f} ms, p99 {p99 * 1000:.0f} ms (n={len(values)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=90.0)
    parser.add_argument("--long-prompt", type=int, default=2000, help="Words in a long prompt (about as many tokens).")
    parser.add_argument("--long-every", type=float, default=4.0)
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--launch-args", default="", help="Extra flags for both launches (a model, say).")
    args = parser.parse_args()
    extra = shlex.split(args.launch_args)
    setups = {"2 ordinary replicas (--dp 2)": ["--dp", "2", "--data-parallel-routing", "least-loaded"],
              "disaggregated (--disaggregate prefill=1,decode=1)": ["--disaggregate", "prefill=1,decode=1"]}
    for name, flags in setups.items():
        launch = LaunchedServer([*BASE, *flags, *extra])
        try:
            stream(launch.url, "warm up", 4)
            result = run_workload(launch.url, args)
            transferred = launch.metric("fleet:kv_transfer_tokens_total")
        finally:
            launch.stop()
        print(f"{name}:")
        print(f"  long outputs ({args.output_len} tokens): TPOT {ms(result['tpot'])}; TTFT {ms(result['decode_ttft'])}")
        print(f"  long prompts ({args.long_prompt} words): TTFT {ms(result['long_ttft'])}")
        print(f"  prompt tokens pulled from a prefill replica: {transferred:.0f}; errors: {len(result['errors'])}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
