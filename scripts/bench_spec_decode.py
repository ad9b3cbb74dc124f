"""Speculative decoding (ngram) against none, on a workload that repeats its prompt (issue 27, point 3).

    python -P scripts/bench_spec_decode.py [--concurrency 1,8] [--requests 8] [--max-tokens 192]
        [--speculative-config '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}'] [--kv-cache-memory-bytes 512M] [--launch-args "extra fleet launch flags"]

The workload is code editing, as a coding assistant sends it: each request (a chat completion,
greedy) gives a seeded, generated Python function and asks for it back with one name changed,
so most of the answer is the prompt again. For each of "off" and "ngram" it starts `fleet
launch` (the default model unless --launch-args names another), sends the requests at each
concurrency, and prints output tok/s, TTFT and TPOT p50 (per request: the time after the first
token over the tokens after it), and with ngram the draft acceptance rate and the tokens each
verifying step produced on average (fleet:spec_decode_* of /metrics). It also counts the answers
that are the same text with and without drafts (greedy output does not change, up to the rounding
differences of a step that computes several positions: see the note it prints).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time

import httpx

from fleet.frontend.bench_serve import Prompt, RequestResult, find_model, percentile, send_request
from fleet.frontend.launched_server import LaunchedServer

DEFAULT_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
NAMES = ["total", "count", "items", "values", "result", "buffer", "offset", "limit", "index", "window", "scale",
         "weights", "tokens", "blocks", "cursor", "record", "params", "bucket", "entries", "score"]
SPEC_COUNTERS = ("fleet:spec_decode_num_drafts_total", "fleet:spec_decode_num_draft_tokens_total",
                 "fleet:spec_decode_num_accepted_tokens_total")


def generated_function(rng: random.Random) -> tuple[str, str, str]:
    """(source, a name in it, a new name): a small, plausible Python function."""
    a, b, c, d = rng.sample(NAMES, 4)
    lines = [f"def update_{a}({a}, {b}, {c}=None):",
             f'    """Return {a} updated from {b}, at most {c} of them."""',
             f"    {d} = []",
             f"    for position, item in enumerate({b}):",
             f"        if {c} is not None and position >= {c}:",
             "            break",
             f"        {d}.append(item * {rng.randint(2, 9)} + {a}[position % len({a})])",
             f"    if not {d}:",
             f"        return {a}",
             f"    return [{a}[i] + {d}[i % len({d})] for i in range(len({a}))]"]
    return "\n".join(lines), b, rng.choice([n for n in NAMES if n not in (a, b, c, d)])


def workload(num_requests: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_requests):
        source, old, new = generated_function(rng)
        prompts.append(f"Rename the parameter `{old}` to `{new}` in this Python function. Reply with the whole "
                       f"function and nothing else.\n\n```python\n{source}\n```")
    return prompts


def chat_body(model: str, text: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": text}], "max_completion_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    return {**body, "stream_options": {"include_usage": True}} if stream else body


async def stream_all(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int
                     ) -> list[RequestResult]:
    in_flight = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async def one(client: httpx.AsyncClient, text: str) -> RequestResult:
        async with in_flight:
            return await send_request(client, url + "/v1/chat/completions", chat_body(model, text, max_tokens, True),
                                      Prompt(text, 0, max_tokens))

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0, connect=10.0)) as client:
        return await asyncio.gather(*(one(client, text) for text in prompts))


def answers(url: str, model: str, prompts: list[str], max_tokens: int) -> list[str]:
    """The answers' texts, one request at a time (their prompts are in the prefix cache by now)."""
    return [httpx.post(url + "/v1/chat/completions", json=chat_body(model, text, max_tokens, False),
                       timeout=1800).json()["choices"][0]["message"]["content"] for text in prompts]


def tpot(result: RequestResult) -> float:
    return (result.latency - result.ttft) / max(result.num_output_tokens - 1, 1)


def run_mode(mode: str, args: argparse.Namespace) -> dict[int, dict]:
    flags = ["--kv-cache-memory-bytes", args.kv_cache_memory_bytes, *shlex.split(args.launch_args)]
    if mode == "ngram":
        flags += ["--speculative-config", args.speculative_config]
    launch = LaunchedServer(flags)
    summaries = {}
    try:
        model = find_model(launch.url, 30)
        asyncio.run(stream_all(launch.url, model, workload(1, seed=999), 1, 8))  # first steps stay out of the numbers
        for concurrency in args.concurrency:
            prompts = workload(args.requests, seed=concurrency)
            before = [launch.metric(name) for name in SPEC_COUNTERS]
            start = time.perf_counter()
            streamed = asyncio.run(stream_all(launch.url, model, prompts, concurrency, args.max_tokens))
            duration = time.perf_counter() - start
            drafts, draft_tokens, accepted = (launch.metric(name) - b for name, b in zip(SPEC_COUNTERS, before))
            results = [result for result in streamed if result.ok]
            summaries[concurrency] = {
                "failed": [result.error for result in streamed if not result.ok],
                "texts": answers(launch.url, model, prompts, args.max_tokens),
                "output_tok_s": sum(r.num_output_tokens for r in results) / duration,
                "ttft_p50": percentile([r.ttft for r in results], 50),
                "tpot_p50": percentile([tpot(r) for r in results], 50),
                "acceptance": accepted / draft_tokens if draft_tokens else float("nan"),
                "tokens_per_verifying_step": 1 + accepted / drafts if drafts else float("nan"),
            }
    finally:
        launch.stop()
    return summaries


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,8", type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--requests", type=int, default=8, help="requests per concurrency")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_NGRAM))
    parser.add_argument("--kv-cache-memory-bytes", default="512M")
    parser.add_argument("--launch-args", default="", help="extra `fleet launch` flags, one shell-quoted string")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"code-edit workload: {args.requests} requests per concurrency, up to {args.max_tokens} tokens out, "
          f"greedy; ngram = {args.speculative_config} {args.launch_args}".rstrip(), flush=True)
    print(f"{'concurrency':>11} {'mode':>5} {'out tok/s':>9} {'TTFT p50':>9} {'TPOT p50':>9} {'accepted':>8} "
          f"{'tok/step':>8} {'same text':>9}", flush=True)
    runs = {}
    for mode in ("off", "ngram"):  # off first: ngram's texts are compared with its
        runs[mode] = run_mode(mode, args)
        for concurrency, summary in runs[mode].items():
            off = runs["off"][concurrency]["texts"]
            same = sum(a == b for a, b in zip(summary["texts"], off, strict=True))
            print(f"{concurrency:>11} {mode:>5} {summary['output_tok_s']:9.1f} {summary['ttft_p50'] * 1e3:7.0f}ms "
                  f"{summary['tpot_p50'] * 1e3:7.1f}ms {summary['acceptance']:8.1%} "
                  f"{summary['tokens_per_verifying_step']:8.2f} {same:>4}/{len(off)}", flush=True)
            for error in summary["failed"][:3]:
                print(f"  error: {error}")
    print("A text that differs: a step that computes several positions (drafts) may round a near tie the other "
          "way where a one-token decode step does not (the default model's GGUF decode rounds activations to Q8).")
    return 1 if any(s["failed"] for run in runs.values() for s in run.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
