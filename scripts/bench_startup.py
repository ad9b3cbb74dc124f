"""Start-up time: from `fleet launch` to the first successful completion.

    python scripts/bench_startup.py [--runs 3] [-- extra launch flags]

Prints each run and the median. Uses the default model unless flags say otherwise.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

import httpx

PORT = 8123


def one_run(extra: list[str]) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "fleet.frontend.cli", "launch", "--port", str(PORT), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fleet launch exited with {proc.returncode}")
            try:
                response = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=5)
                if response.status_code == 200:
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    times = []
    for run in range(args.runs):
        seconds = one_run(extra)
        times.append(seconds)
        print(f"run {run + 1}: {seconds:.2f} s from `fleet launch` to the first completion")
    print(f"median: {statistics.median(times):.2f} s ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
