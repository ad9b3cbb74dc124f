"""What KV pulls from a producer that never answers cost everyone else (issue 42, point 3).

    python -P scripts/bench_kv_pull_stall.py [--silent 4] [--requests 5] [--transfer-timeout 10]

Launches the default model as a decode instance (--kv-transfer-config kv_consumer),
then times --requests plain completions (32 tokens) alone, and again while
--silent requests wait for KV from a producer of this script's own on 127.0.0.1
that never answers (each of those is computed locally after --transfer-timeout s).
Prints the plain requests' latency p50/max in both cases and how long the silent
ones took.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import httpx
import zmq

from fleet.frontend.kv_transfer_gate import SECRET_HEADER
from fleet.frontend.launched_server import LaunchedServer

SECRET = "bench-kv-pull-stall-secret"


def complete(url: str, prompt: str, headers: dict | None = None, **extra) -> float:
    started = time.monotonic()
    body = {"prompt": prompt, "max_tokens": 32, "min_tokens": 32, "ignore_eos": True, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=600)
    response.raise_for_status()
    return time.monotonic() - started


def plain_latencies(url: str, count: int) -> list[float]:
    return [complete(url, f"Plain request {i}: the history of the river") for i in range(count)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--silent", type=int, default=4, help="requests whose KV pull never gets an answer")
    parser.add_argument("--requests", type=int, default=5, help="plain requests timed in each case")
    parser.add_argument("--transfer-timeout", type=float, default=10.0, help="transfer_timeout_s of the instance")
    args = parser.parse_args()
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)  # takes pulls, answers none
    address = f"tcp://127.0.0.1:{silent.bind_to_random_port('tcp://127.0.0.1')}"
    config = json.dumps({"kv_role": "kv_consumer",
                         "kv_connector_extra_config": {"secret": SECRET, "transfer_timeout_s": args.transfer_timeout}})
    server = LaunchedServer(["--kv-transfer-config", config, "--kv-cache-memory-bytes", "256M"])
    try:
        url = server.url
        complete(url, "warm up")
        alone = plain_latencies(url, args.requests)
        tokenizer_ids = httpx.post(url + "/tokenize", json={"prompt": "a prompt whose KV never comes"}).json()["tokens"]
        params = {"do_remote_prefill": True, "transfer_id": "ab" * 16, "remote_num_tokens": len(tokenizer_ids),
                  "remote_kv_addresses": [address], "remote_release_address": address}
        silent_times: list[float] = []
        threads = [threading.Thread(target=lambda: silent_times.append(complete(
            url, tokenizer_ids, headers={SECRET_HEADER: SECRET}, kv_transfer_params=params)))
            for _ in range(args.silent)]
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # the silent pulls have started
        beside = plain_latencies(url, args.requests)
        for thread in threads:
            thread.join()
    finally:
        server.stop()
        ctx.destroy(linger=0)
    print(f"plain request latency alone:          p50 {statistics.median(alone):.2f} s, max {max(alone):.2f} s")
    print(f"plain request latency beside {args.silent} silent pulls: p50 {statistics.median(beside):.2f} s, "
          f"max {max(beside):.2f} s")
    print(f"the silent requests took {min(silent_times):.1f}-{max(silent_times):.1f} s "
          f"(transfer_timeout_s {args.transfer_timeout:g}, then computed locally)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
