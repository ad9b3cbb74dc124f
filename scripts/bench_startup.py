"""Start-up time: from `fleet launch` to the first successful completion.

    python scripts/bench_startup.py [--runs 3] [--prepared | --no-prebuilt-kernels] [-- extra launch flags]

The first run is a first launch: by default with an empty fleet cache (nothing
derived from the model's files yet, as without `fleet prepare`) and the CPU
kernels that `make install` built; --prepared: with fleet's own cache as
`make install` (`fleet prepare`) left it, i.e. the first launch after install;
--no-prebuilt-kernels: the kernels are built at start-up too, into an empty
torch extensions folder. The other runs are warm restarts. Each run also prints the resident memory
of the whole process tree once it answered. Uses the default model unless the
flags say otherwise.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

PORT = 8123


def one_run(extra: list[str], env: dict[str, str]) -> tuple[float, int]:
    """Seconds to the first completion, and the tree's RSS then."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", "--port", str(PORT), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"fleet launch exited with {proc.returncode}")
            try:
                body = {"prompt": "Hi", "max_tokens": 1}
                response = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", json=body, timeout=5)
                if response.status_code == 200:
                    return time.perf_counter() - start, tree_rss(proc.pid)
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="the first start and runs - 1 warm restarts")
    parser.add_argument("--prepared", action="store_true",
                        help="the first start uses fleet's cache as `make install` left it")
    parser.add_argument("--no-prebuilt-kernels", action="store_true",
                        help="the first start also builds the CPU kernels (an empty TORCH_EXTENSIONS_DIR)")
    args, extra = parser.parse_known_args()
    extra = [a for a in extra if a != "--"]
    with tempfile.TemporaryDirectory(prefix="fleet-bench-startup-") as scratch:
        env = dict(os.environ)
        if not args.prepared:
            env["FLEET_CACHE_DIR"] = os.path.join(scratch, "fleet-cache")
        if args.no_prebuilt_kernels:
            env["TORCH_EXTENSIONS_DIR"] = os.path.join(scratch, "torch-extensions")
        warm = []
        for run in range(args.runs):
            seconds, rss = one_run(extra, env)
            first = "first start (prepared cache)" if args.prepared else "first start (empty fleet cache)"
            kind = first if run == 0 else "warm restart"
            print(f"run {run + 1}: {seconds:.2f} s to the first completion, {kind}; "
                  f"process tree RSS {rss / 2**30:.2f} GiB")
            if run:
                warm.append(seconds)
    if warm:
        print(f"warm restart median: {statistics.median(warm):.2f} s ({os.cpu_count()} CPUs)")


if __name__ == "__main__":
    main()
