"""The GPU smoke test, for a person with a CUDA machine, in one command:

    python -P scripts/gpu_smoke.py [--tokens 64] [--prompts 32]

1. Every Triton kernel against its torch reference on the GPU: the cases of
   tests/kernels/test_triton_kernels.py, compiled instead of interpreted.
2. The default model served with `--tp 1` on CUDA and, where the machine has
   3 GPUs or more, `--tp 3` (SmolLM2-135M has 9 attention heads: 2 does not
   divide them). Each is loaded with `fleet bench serve` and a greedy
   completion is checked to come back.

Prints one line per step, PASS or FAIL with tok/s, and exits 1 on any
failure. Without a CUDA device it runs nothing, says so, and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

CHECKOUT = Path(__file__).resolve().parents[1]
READY = re.compile(r"serving .* on (http://\S+)")
STARTUP_TIMEOUT_S = 600


def kernels() -> bool:
    done = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "-q", str(CHECKOUT / "tests/kernels/test_triton_kernels.py")],
        env={**os.environ, "FLEET_TRITON_TEST_DEVICE": "cuda"}, cwd=CHECKOUT, capture_output=True, text=True,
    )
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    print(f"{'PASS' if done.returncode == 0 else 'FAIL'} Triton kernels on the GPU: {summary}")
    if done.returncode != 0:
        print(done.stdout[-4000:])
    return done.returncode == 0


def serve(tp: int, prompts: int, tokens: int) -> bool:
    """Launch, wait for the URL, complete greedily once, benchmark; always stop the launch."""
    command = ["launch", "--device", "cuda", "--tp", str(tp), "--port", "0"]
    launch = subprocess.Popen([sys.executable, "-P", "-m", "fleet.frontend.cli", *command], cwd=CHECKOUT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = _wait_for_url(launch)
        if url is None:
            print(f"FAIL serve --tp {tp}: the launch did not come up")
            return False
        reply = httpx.post(f"{url}/v1/completions", timeout=120,
                           json={"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
                                 "temperature": 0}).json()
        text = reply["choices"][0]["text"]
        throughput = _bench(url, prompts, tokens)
        ok = bool(text) and throughput > 0
        print(f"{'PASS' if ok else 'FAIL'} serve --tp {tp}: {throughput:.1f} output tok/s; greedy reply {text!r}")
        return ok
    finally:
        launch.terminate()
        try:
            launch.wait(30)
        except subprocess.TimeoutExpired:
            launch.kill()


def _wait_for_url(launch: subprocess.Popen) -> str | None:
    """The launch's URL once it serves; its log goes on being shown (and its pipe drained) after that."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    for line in launch.stdout:
        sys.stdout.write(f"  | {line}")
        match = READY.search(line)
        if match:
            threading.Thread(target=_show_rest, args=(launch,), daemon=True).start()
            return match.group(1)
        if time.monotonic() > deadline:
            break
    return None


def _show_rest(launch: subprocess.Popen) -> None:
    for line in launch.stdout:
        sys.stdout.write(f"  | {line}")


def _bench(url: str, prompts: int, tokens: int) -> float:
    with tempfile.TemporaryDirectory() as directory:
        result = Path(directory) / "result.json"
        subprocess.run(
            [sys.executable, "-P", "-m", "fleet.frontend.cli", "bench", "serve", "--base-url", url,
             "--num-prompts", str(prompts), "--max-concurrency", "8", "--random-input-len", "128",
             "--random-output-len", str(tokens), "--result-json", str(result)],
            cwd=CHECKOUT, check=True, capture_output=True,
        )
        summary = json.loads(result.read_text())
    return summary["output_throughput"] if summary["failed"] == 0 else 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("NOT RUN: no CUDA device on this machine, so no kernel and no launch was checked on a GPU")
        return 2
    print(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    results = [kernels(), serve(1, args.prompts, args.tokens)]
    if torch.cuda.device_count() >= 3:
        results.append(serve(3, args.prompts, args.tokens))
    else:
        print("NOT RUN serve --tp 3: fewer than 3 GPUs")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
