"""The cost of structured outputs on any OpenAI-compatible server: output
tokens per second of chat completions constrained by a JSON schema, next to
the same requests unconstrained, each made to give exactly as many tokens
as its constrained twin (so both runs have the same batch over time), at
each concurrency.

    python scripts/bench_structured.py --base-url http://127.0.0.1:8000 [--concurrency 1 8] [--requests 8]

Prints, per concurrency, tok/s with and without the schema and their ratio.
The first request of each kind warms up and is not counted.
"""
from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

SCHEMA = {
    "type": "array",
    "minItems": 6,
    "maxItems": 6,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "city": {"type": "string", "maxLength": 16},
        },
        "required": ["name", "age", "city"],
        "additionalProperties": False,
    },
}
MAX_TOKENS = 400
MESSAGES = [{"role": "user", "content": "List six people, each with a name, an age and a city, as JSON."}]


def chat(client: httpx.Client, url: str, model: str, seed: int, tokens: int | None) -> int:
    """One completion: constrained by SCHEMA (tokens None), else exactly `tokens` tokens, free."""
    body = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.7, "seed": seed}
    if tokens is None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "people", "schema": SCHEMA}}
    else:
        body.update(max_tokens=tokens, min_tokens=tokens, ignore_eos=True)
    response = client.post(f"{url}/v1/chat/completions", json=body)
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


def run(url: str, model: str, concurrency: int, lengths: list[int | None]) -> tuple[list[int], float]:
    """Requests i = 1.. (seed i, length lengths[i - 1]) at `concurrency`: their token counts, and tok/s."""
    with httpx.Client(timeout=600) as client:
        chat(client, url, model, 0, lengths[0])  # warm-up
        start = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            tokens = list(pool.map(lambda i: chat(client, url, model, i + 1, lengths[i]), range(len(lengths))))
        return tokens, sum(tokens) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="served model name (default: the first of /v1/models)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--requests", type=int, default=8, help="requests per measurement")
    args = parser.parse_args()
    url = args.base_url.rstrip("/")
    model = args.model or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    print(f"{'concurrency':>11} {'schema tok/s':>12} {'free tok/s':>10} {'ratio':>6}")
    for concurrency in args.concurrency:
        count = max(args.requests, concurrency)
        lengths, constrained = run(url, model, concurrency, [None] * count)
        _, free = run(url, model, concurrency, list(lengths))
        print(f"{concurrency:>11} {constrained:>12.1f} {free:>10.1f} {constrained / free:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
