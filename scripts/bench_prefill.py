"""Prefill cost on any OpenAI-compatible server: the latency of one-token
completions of random token-id prompts, one at a time, per prompt length.

    python scripts/bench_prefill.py --base-url http://127.0.0.1:8000 [--lengths 256 2048] [--repeats 8]

Prints, per length, the median and minimum latency and the median per
prompt token. The first two requests of each length warm up and are not counted.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import httpx

WARM_UP = 2


def one_token_latency_ms(client: httpx.Client, url: str, model: str, prompt: list[int]) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    start = time.perf_counter()
    response = client.post(f"{url}/v1/completions", json=body)
    elapsed = (time.perf_counter() - start) * 1e3
    response.raise_for_status()
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    url = args.base_url.rstrip("/")
    rng = random.Random(args.seed)
    with httpx.Client(timeout=600) as client:
        try:
            model = args.model or client.get(f"{url}/v1/models").json()["data"][0]["id"]
        except httpx.HTTPError as error:
            print(f"cannot reach {url}: {error}", file=sys.stderr)
            return 1
        for length in args.lengths:
            times = [
                one_token_latency_ms(client, url, model, [rng.randrange(1000, 30000) for _ in range(length)])
                for _ in range(WARM_UP + args.repeats)
            ][WARM_UP:]
            median = statistics.median(times)
            print(f"prompt {length:5d} tokens: one-token completion median {median:8.1f} ms, min {min(times):8.1f} ms,"
                  f" {median / length:.2f} ms per prompt token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
