"""Cache-aware routing against least-loaded over data-parallel replicas (issue 29).

    python -P scripts/bench_prefix_routing.py [--groups 16] [--requests 256] [--concurrency 32]
        [--system-tokens 1000] [--user-tokens 16] [--max-tokens 16] [--kv-cache-memory-bytes 256M]
        [--modes least-loaded,cache-aware] [--launch-args "extra fleet launch flags"]

For each routing mode it starts `fleet launch --dp 2 --data-parallel-routing MODE` (the default
model unless --launch-args names another) and sends the same workload: --groups system prompts
of --system-tokens random token ids, each shared by --requests / --groups requests that add
--user-tokens of their own and ask for --max-tokens tokens (streamed, greedy, ignoring eos), in
a seeded random order, --concurrency at a time. Prints per mode the prefix-cache hit rate of
the workload (fleet:prefix_cache_hits / queries of /metrics, summed over replicas), the requests
each replica ran, why each was picked (fleet:routing_decisions), TTFT p50/p99 as the client saw it,
and the total time.

The default KV cache (256M per replica, about 11k tokens of the default model in bfloat16) holds
the system prompts of half the groups but not of all 16: least-loaded routing sends every
group to both replicas, whose caches then evict what the next request of a group needs.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import shlex
import sys
import time

import httpx

from fleet.frontend.bench_serve import Prompt, RequestResult, find_model, percentile, send_request
from fleet.frontend.launched_server import LaunchedServer

VOCAB = range(1000, 40000)
"""Token ids drawn for prompts: ordinary tokens of the default model's vocabulary (not its specials)."""


class Launch(LaunchedServer):
    def __init__(self, routing: str, kv_cache: str, extra: list[str]):
        super().__init__(["--dp", "2", "--kv-cache-memory-bytes", kv_cache, "--data-parallel-routing", routing, *extra])
        count = argparse.ArgumentParser(add_help=False)
        count.add_argument("--api-server-count", type=int, default=1)
        self.num_api_servers = count.parse_known_args(extra)[0].api_server_count

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics, summed over the API servers and over its labels but engine and
        reason: `name{engine="0"}` or `name`. (Each API server counts what it saw: the kernel hands
        each new connection to one of them, so ask until every one answered.)"""
        pages: dict[str, str] = {}
        for _ in range(100 * self.num_api_servers):
            response = httpx.get(self.url + "/metrics", timeout=10)
            pages[response.headers["fleet-api-server"]] = response.text
            if len(pages) == self.num_api_servers:
                break
        else:
            raise RuntimeError(f"only API servers {sorted(pages)} of {self.num_api_servers} answered /metrics")
        samples: dict[str, float] = {}
        for line in "\n".join(pages.values()).splitlines():
            match = re.match(r'([a-z_:]+)(\{.*\})? (\S+)$', line)
            if not match:
                continue
            keep = re.findall(r'\b(?:engine|reason)="[^"]*"', match.group(2) or "")
            key = match.group(1) + ("{" + ",".join(keep) + "}" if keep else "")
            samples[key] = samples.get(key, 0.0) + float(match.group(3))
        return samples


def workload(args: argparse.Namespace) -> list[list[int]]:
    """The prompts in sending order: every group's system prompt and a user part of each request's own."""
    rng = random.Random(args.seed)
    systems = [[rng.choice(VOCAB) for _ in range(args.system_tokens)] for _ in range(args.groups)]
    groups = [g % args.groups for g in range(args.requests)]
    rng.shuffle(groups)
    return [systems[g] + [rng.choice(VOCAB) for _ in range(args.user_tokens)] for g in groups]


async def send_all(url: str, model: str, prompts: list[list[int]], args: argparse.Namespace) -> list[RequestResult]:
    in_flight = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> RequestResult:
        body = {"model": model, "prompt": ids, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        async with in_flight:
            return await send_request(client, url + "/v1/completions", body, Prompt("", len(ids), args.max_tokens))

    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(1800.0, connect=10.0)) as client:
        return await asyncio.gather(*(one(client, ids) for ids in prompts))


def run_mode(routing: str, args: argparse.Namespace) -> dict:
    launch = Launch(routing, args.kv_cache_memory_bytes, shlex.split(args.launch_args))
    try:
        model = find_model(launch.url, 30)
        # One short request first: the replicas' first steps (lazy set-up) stay out of the numbers.
        asyncio.run(send_all(launch.url, model, [[VOCAB[0]] * 8, [VOCAB[1]] * 8], args))
        before = launch.metrics()
        start = time.perf_counter()
        results = asyncio.run(send_all(launch.url, model, workload(args), args))
        duration = time.perf_counter() - start
        after = launch.metrics()
    finally:
        launch.stop()
    grew = {key: after[key] - before.get(key, 0.0) for key in after}

    def total(name: str) -> float:
        return sum(value for key, value in grew.items() if key.startswith(name + "{") or key == name)

    failed = [r.error for r in results if not r.ok]
    ttfts = [r.ttft for r in results if r.ok]
    queries = total("fleet:prefix_cache_queries_total")
    return {
        "routing": routing,
        "ok": len(ttfts),
        "failed": failed,
        "hit_rate": total("fleet:prefix_cache_hits_total") / queries if queries else float("nan"),
        "per_replica": {engine: grew.get(f'fleet:request_success_total{{engine="{engine}"}}', 0.0) for engine in "01"},
        "decisions": {key.split('"')[1]: value for key, value in grew.items()
                      if key.startswith("fleet:routing_decisions_total{") and value},
        "ttft_p50": percentile(ttfts, 50) if ttfts else float("nan"),
        "ttft_p99": percentile(ttfts, 99) if ttfts else float("nan"),
        "duration": duration,
    }


def report(summary: dict) -> str:
    replicas = ", ".join(f"dp{engine} {count:.0f}" for engine, count in summary["per_replica"].items())
    decisions = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(summary["decisions"].items()))
    lines = [
        f"== --data-parallel-routing {summary['routing']}",
        f"  requests ok {summary['ok']}, failed {len(summary['failed'])}; per replica: {replicas}; picks: {decisions}",
        f"  prefix cache hit rate {summary['hit_rate']:.1%}",
        f"  TTFT p50 {summary['ttft_p50']:.2f} s, p99 {summary['ttft_p99']:.2f} s",
        f"  total time {summary['duration']:.1f} s",
    ]
    lines += [f"  error: {error}" for error in summary["failed"][:3]]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=16, help="system prompts (G)")
    parser.add_argument("--requests", type=int, default=256, help="requests in all (R), spread evenly over the groups")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--user-tokens", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", default="256M", help="each replica's KV cache")
    parser.add_argument("--modes", default="least-loaded,cache-aware", help="routing modes to run, in order")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--launch-args", default="", help="extra `fleet launch` flags, one shell-quoted string")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"{args.groups} system prompts of {args.system_tokens} tokens, {args.requests} requests "
          f"(+{args.user_tokens} tokens each, {args.max_tokens} out), {args.concurrency} at a time; "
          f"--dp 2 --kv-cache-memory-bytes {args.kv_cache_memory_bytes} {args.launch_args}".rstrip(), flush=True)
    summaries = []
    for routing in args.modes.split(","):
        summaries.append(run_mode(routing, args))
        print(report(summaries[-1]), flush=True)
    return 1 if any(summary["failed"] for summary in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
