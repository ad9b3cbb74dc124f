"""`fleet bench serve`: a serving load generator for any OpenAI-compatible
server (fleet, vLLM, llama.cpp).

Like `vllm bench serve --dataset-name random`: random prompts, streamed
completions, and request/token throughput, TTFT, ITL, TPOT and E2E latency.

    fleet bench serve --base-url http://127.0.0.1:8000 \\
        [--endpoint /v1/completions|/v1/chat/completions] [--model NAME] \\
        [--num-prompts 16] [--max-concurrency 4] [--request-rate inf] \\
        [--random-input-len 256] [--random-output-len 128] [--tokenizer HF_DIR] \\
        [--result-json out.json] [--label fleet-bf16]

Without --model, the first id of GET /v1/models is used. With --tokenizer,
prompts are random token ids decoded to text (input lengths about right in
tokens); without it, prompts are random words (input lengths approximate).
Exits 1 when the server cannot be reached or no request succeeds.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

WORDS = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
NUM_ERRORS_SHOWN = 3


class BenchmarkError(RuntimeError):
    """The benchmark cannot run at all (server unreachable, no model)."""


@dataclass
class Prompt:
    text: str
    num_tokens: int  # exact with a tokenizer, an estimate without
    max_tokens: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    ttft: float = 0.0  # seconds from send to the first chunk carrying text
    latency: float = 0.0  # seconds from send to the end of the stream
    itl: list[float] = field(default_factory=list)  # gaps between chunks carrying text


# ---- dataset --------------------------------------------------------------------------------


def sample_length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1 (vLLM's convention)."""
    low, high = math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_token_text(rng: random.Random, tokenizer, length: int) -> tuple[str, int]:
    """Random non-special token ids decoded to text; re-encoded and cut so the text is ~`length` tokens."""
    special = set(tokenizer.all_special_ids)
    choices = [i for i in range(len(tokenizer)) if i not in special]
    ids = [rng.choice(choices) for _ in range(length)]
    # Decoding then encoding merges or splits some tokens, so cut to length after one round trip.
    ids = tokenizer.encode(tokenizer.decode(ids), add_special_tokens=False)[:length]
    text = tokenizer.decode(ids)
    return text, len(ids)


def random_prompts(args: argparse.Namespace) -> list[Prompt]:
    rng = random.Random(args.seed)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    prompts = []
    for _ in range(args.num_prompts):
        input_len = sample_length(rng, args.random_input_len, args.random_range_ratio)
        output_len = sample_length(rng, args.random_output_len, args.random_range_ratio)
        if tokenizer is not None:
            text, num_tokens = random_token_text(rng, tokenizer, input_len)
        else:
            text, num_tokens = " ".join(rng.choices(WORDS, k=input_len)), input_len
        prompts.append(Prompt(text, num_tokens, output_len))
    return prompts


# ---- one request ----------------------------------------------------------------------------


def request_body(args: argparse.Namespace, model: str, prompt: Prompt) -> dict:
    body = {
        "model": model,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": args.ignore_eos,
    }
    if args.endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt.text}]
        body["max_completion_tokens"] = prompt.max_tokens
    else:
        body["prompt"] = prompt.text
        body["max_tokens"] = prompt.max_tokens
    return body


def parse_event(data: str) -> tuple[str, str | None, dict | None]:
    """One SSE `data:` payload -> (text, finish_reason, usage). Raises ValueError on an error event."""
    event = json.loads(data)
    if "error" in event:
        raise ValueError(f"error event: {event['error']}")
    text, finish_reason = "", None
    for choice in event.get("choices") or []:
        delta = choice.get("delta") or {}
        text += choice.get("text") or delta.get("content") or ""
        finish_reason = choice.get("finish_reason") or finish_reason
    return text, finish_reason, event.get("usage")


async def send_request(client: httpx.AsyncClient, url: str, body: dict, prompt: Prompt) -> RequestResult:
    result = RequestResult(num_prompt_tokens=prompt.num_tokens)
    start = last = time.perf_counter()
    num_chunks, finish_reason, usage = 0, None, None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {response.status_code}: {detail}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                text, finish, event_usage = parse_event(line[5:].strip())
                now = time.perf_counter()
                finish_reason, usage = finish or finish_reason, event_usage or usage
                if text:
                    if num_chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    num_chunks, last = num_chunks + 1, now
    except (httpx.HTTPError, ValueError) as error:
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.latency = time.perf_counter() - start
    if finish_reason is None or num_chunks == 0:
        result.error = f"stream ended without finishing ({num_chunks} text chunks, {finish_reason=})"
        return result
    result.num_output_tokens = usage["completion_tokens"] if usage else num_chunks
    result.num_prompt_tokens = usage["prompt_tokens"] if usage else prompt.num_tokens
    result.ok = True
    return result


# ---- the run --------------------------------------------------------------------------------


def find_model(base_url: str, timeout: float) -> str:
    try:
        response = httpx.get(f"{base_url}/v1/models", timeout=timeout)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as error:
        reason = f"{type(error).__name__}: {error}"
        raise BenchmarkError(f"cannot get a model from {base_url}/v1/models ({reason})") from error


async def send_all(args: argparse.Namespace, model: str, prompts: list[Prompt]) -> tuple[list[RequestResult], float]:
    """Send every prompt, Poisson arrivals at --request-rate, at most --max-concurrency in flight."""
    url = args.base_url + args.endpoint
    rng = random.Random(args.seed + 1)
    concurrency = args.max_concurrency or max(len(prompts), 1)
    in_flight = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(args.request_timeout, connect=min(args.request_timeout, 10.0))

    async def limited(prompt: Prompt) -> RequestResult:
        async with in_flight:
            return await send_request(client, url, request_body(args, model, prompt), prompt)

    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if math.isfinite(args.request_rate):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def ms_stats(name: str, seconds: list[float]) -> dict:
    """mean/median/p99 in ms; None where there is nothing to measure."""
    values = [s * 1000 for s in seconds]
    if not values:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, f"p99_{name}_ms": None}
    return {
        f"mean_{name}_ms": sum(values) / len(values),
        f"median_{name}_ms": percentile(values, 50),
        f"p99_{name}_ms": percentile(values, 99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    """vLLM's result names, so the JSON compares with `vllm bench serve --save-result`."""
    done = [r for r in results if r.ok]
    input_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.num_output_tokens - 1) for r in done if r.num_output_tokens > 1]
    return {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        **ms_stats("ttft", [r.ttft for r in done]),
        **ms_stats("tpot", tpot),
        **ms_stats("itl", [gap for r in done for gap in r.itl]),
        **ms_stats("e2el", [r.latency for r in done]),
        "errors": [r.error for r in results if not r.ok],
    }


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the whole benchmark; returns the summary (see `summarize`) plus the settings used."""
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    model = args.model or find_model(args.base_url, min(args.request_timeout, 30.0))
    prompts = random_prompts(args)
    results, duration = asyncio.run(send_all(args, model, prompts))
    rate = args.request_rate if math.isfinite(args.request_rate) else "inf"  # JSON has no Infinity
    settings = {
        "label": args.label, "base_url": args.base_url, "endpoint": args.endpoint, "model": model,
        "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency, "request_rate": rate,
        "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
    }
    return {**settings, **summarize(results, duration)}


# ---- report ---------------------------------------------------------------------------------


def format_report(summary: dict) -> str:
    def row(name: str, value) -> str:
        shown = "n/a" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{name:<40} {shown:<10}"

    def stats(title: str, key: str, label: str, kinds: tuple[str, ...] = ("mean", "median", "p99")) -> list[str]:
        names = {"mean": "Mean", "median": "Median", "p99": "P99"}
        return [f"{title:-^50}", *(row(f"{names[k]} {label} (ms):", summary[f"{k}_{key}_ms"]) for k in kinds)]

    title = " Serving Benchmark Result " + (f"({summary['label']}) " if summary["label"] else "")
    lines = [
        f"{title:=^50}",
        row("Successful requests:", summary["completed"]),
        row("Failed requests:", summary["failed"]),
        row("Maximum request concurrency:", summary["max_concurrency"]),
        row("Request rate (req/s):", summary["request_rate"]),
        row("Benchmark duration (s):", summary["duration"]),
        row("Total input tokens:", summary["total_input_tokens"]),
        row("Total generated tokens:", summary["total_output_tokens"]),
        row("Request throughput (req/s):", summary["request_throughput"]),
        row("Output token throughput (tok/s):", summary["output_throughput"]),
        row("Total token throughput (tok/s):", summary["total_token_throughput"]),
        *stats("Time to First Token", "ttft", "TTFT"),
        *stats("Time per Output Token (excl. 1st token)", "tpot", "TPOT", ("mean",)),
        *stats("Inter-token Latency", "itl", "ITL"),
        *stats("End-to-end Latency", "e2el", "E2EL", ("mean",)),
        "=" * 50,
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="fleet bench serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=None, help="default: no limit")
    parser.add_argument("--request-rate", type=float, default=math.inf, help="req/s, Poisson arrivals; default inf")
    parser.add_argument("--random-input-len", type=int, default=256)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer directory, for input lengths in tokens")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--result-json", default=None)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    if not 0 <= args.random_range_ratio < 1:
        parser.error(f"--random-range-ratio must be in [0, 1), got {args.random_range_ratio}")
    if args.request_rate <= 0 or (args.max_concurrency is not None and args.max_concurrency < 1):
        parser.error(f"{args.request_rate=} must be > 0 and {args.max_concurrency=} >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        summary = run_benchmark(args)
    except BenchmarkError as error:
        sys.exit(f"bench_serve: error: {error}")
    print(format_report(summary))
    for error in summary["errors"][:NUM_ERRORS_SHOWN]:
        print(f"failed request: {error}", file=sys.stderr)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(summary, f, indent=2)
    if summary["completed"] == 0:
        sys.exit(f"bench_serve: error: all {summary['failed']} requests failed")


if __name__ == "__main__":
    main()
