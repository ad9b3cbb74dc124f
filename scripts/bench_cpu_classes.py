"""Serving speed of `fleet launch` (the default model unless flags say
otherwise) as each CPU class runs it: c=1 TPOT and c=32 output tokens/s.

    python -P scripts/bench_cpu_classes.py [--classes amx avx2] [--concurrency 1 32] [-- extra launch flags]

For every class (default: this machine's and each one below it down to avx2)
it starts `fleet launch` under FLEET_CPU_ISA, waits for it, runs `fleet bench
serve` (256 random tokens in, 128 out, N = max(8, 2 x concurrency), the
workload of shared/BENCHMARKS.md) at each concurrency, stops it, and prints
one line per class and concurrency. Compare numbers within one run only.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

from fleet.config.cpu_class import classes_below_this_machine, machine_cpu_class
from fleet.frontend.bench_serve import parse_args, run_benchmark


def serving(cpu_class: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """A `fleet launch` of the class on a free port, once it answers: (process, base URL)."""
    env = {**os.environ, "FLEET_CPU_ISA": cpu_class, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", "--port", "0", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    found: list[str] = []
    ready = threading.Event()

    def read_log() -> None:
        for line in proc.stdout:
            if "CPU class" in line:
                print("   ", line.strip()[-170:])
            match = re.search(r"serving .* on (http://\S+)", line)
            if match:
                found.append(match.group(1))
                ready.set()

    threading.Thread(target=read_log, daemon=True).start()
    deadline = time.monotonic() + 600
    while not ready.wait(0.5):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"fleet launch under FLEET_CPU_ISA={cpu_class} did not start")
    return proc, found[0]


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def measure(base_url: str, concurrency: int, num_prompts: int | None = None, seed: int = 0) -> dict:
    args = parse_args([
        "--base-url", base_url, "--num-prompts", str(num_prompts or max(8, 2 * concurrency)),
        "--max-concurrency", str(concurrency), "--random-input-len", "256", "--random-output-len", "128",
        "--ignore-eos", "--seed", str(seed),
    ])
    return run_benchmark(args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_classes = [machine_cpu_class().name, *(cls.name for cls in classes_below_this_machine())]
    parser.add_argument("--classes", nargs="+", default=default_classes)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 32])
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"] or ["--kv-cache-memory-bytes", "1G"]
    for cpu_class in args.classes:
        proc, base_url = serving(cpu_class, extra)
        try:
            measure(base_url, 1, num_prompts=2, seed=1)  # warm-up (other prompts: no prefix-cache hits later)
            for concurrency in args.concurrency:
                result = measure(base_url, concurrency)
                print(f"{cpu_class:12} c={concurrency:<3} output {result['output_throughput']:7.1f} tok/s   "
                      f"TTFT p50 {result['median_ttft_ms']:7.0f} ms   TPOT p50 {result['median_tpot_ms']:6.1f} ms   "
                      f"failed {result['failed']}", flush=True)
        finally:
            stop(proc)


if __name__ == "__main__":
    main()
