"""What the serving path costs next to the forward, at one request (c=1):

  forward   the model's forward of one decode row plus its logits, in this
            process, on metadata built before the clock starts;
  engine    EngineCore.step with the worker in this process (`uni`): the
            scheduler, the runner's batch, the forward, the sampler;
  worker    EngineCore.step with the worker in its own process (`mp`, over
            ZMQ), and of it the time outside the executor's round trip: what
            the engine does while the worker waits for its next step (all that
            overlapping the scheduling with the forward could hide);
  served    the time per output token of one streamed request to a
            `fleet launch` this script starts (API process, engine core and
            worker as users run them, over ZMQ and HTTP).

Each decodes `--tokens` tokens after a prompt of `--prompt-len` random token
ids, greedily; the same positions in each. Prints the median per token and
each layer's ratio to the forward.

    python -P scripts/bench_step_overhead.py [--model M] [--tokens 256] [--prompt-len 256]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx
import torch

from fleet.config import EngineArgs
from fleet.config.model import DEFAULT_MODEL
from fleet.core.engine_core import EngineCore
from fleet.core.launch.engine_process import build_engine_core
from fleet.core.launch.node_plan import engine_core_plans
from fleet.core.messages import EngineCoreRequest
from fleet.core.sampling_params import SamplingParams
from fleet.kernels.attention import AttentionMetadata

KV_BUDGET = "256M"


def forward_ms(engine: EngineCore, prompt: list[int], tokens: int) -> list[float]:
    """Per decode token: the model's forward of one row and its logits, nothing else."""
    runner = engine.executor.worker.runner
    model, kv_caches, block_size = runner.model, runner.kv_caches, runner.block_size
    blocks = list(range(-(-(len(prompt) + tokens) // block_size)))
    device = runner.device

    def metadata(query_len: int, seq_len: int) -> AttentionMetadata:
        return AttentionMetadata.build([query_len], [seq_len], [blocks], block_size, device)

    with torch.inference_mode():
        ids = torch.tensor(prompt, device=device)
        hidden = model(ids, torch.arange(len(prompt), device=device), kv_caches, metadata(len(prompt), len(prompt)), None)
        token = int(model.compute_logits(hidden[-1:]).argmax())
        steps = [(len(prompt) + i, metadata(1, len(prompt) + i + 1)) for i in range(tokens)]
        times = []
        for position, attention in steps:
            start = time.perf_counter()
            hidden = model(torch.tensor([token], device=device), torch.tensor([position], device=device),
                           kv_caches, attention, None)
            token = int(model.compute_logits(hidden).argmax())
            times.append((time.perf_counter() - start) * 1e3)
    return times


def engine_step_ms(engine: EngineCore, prompt: list[int], tokens: int) -> list[float]:
    """Per decode token: one EngineCore.step, scheduler and sampler included."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens + 1, ignore_eos=True)
    engine.add_request(EngineCoreRequest("bench", prompt, params, time.time()))
    engine.step()  # the prompt
    times = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    return times[:tokens]


def worker_process_ms(config, prompt: list[int], tokens: int) -> tuple[list[float], list[float]]:
    """Per decode token: one EngineCore.step with a worker process, and the step's time outside
    the executor's round trip (the engine's own work, while the worker waits)."""
    engine = build_engine_core(config, engine_core_plans(config, [0], clients=[], coordinator=None)[0])
    round_trips = []
    execute = engine.executor.execute

    def timed_execute(scheduler_output):
        start = time.perf_counter()
        result = execute(scheduler_output)
        round_trips.append((time.perf_counter() - start) * 1e3)
        return result

    engine.executor.execute = timed_execute
    try:
        engine_step_ms(engine, prompt, 16)  # warm up
        round_trips.clear()
        steps = engine_step_ms(engine, prompt, tokens)
    finally:
        engine.shutdown()
    return steps, [step - trip for step, trip in zip(steps, round_trips[1:])]  # [0]: the prompt's step


def served_ms(model: str, prompt: list[int], tokens: int) -> list[float]:
    """Per output token of one streamed completion from a `fleet launch` started here."""
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", model, "--host", "127.0.0.1",
         "--port", str(port), "--kv-cache-memory-bytes", KV_BUDGET],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, server)
        body = {"model": httpx.get(f"{url}/v1/models").json()["data"][0]["id"], "prompt": prompt,
                "max_tokens": tokens + 1, "temperature": 0, "ignore_eos": True, "stream": True}
        for _ in range(2):  # the first request warms the server up
            arrivals = []
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"]:
                        arrivals.append(time.perf_counter())
        return [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(60)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str, server: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"fleet launch exited with {server.returncode}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"fleet launch not ready within {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = EngineArgs(model=args.model, kv_cache_memory_bytes=KV_BUDGET,
                        distributed_executor_backend="uni").create_config()
    vocab = config.model.hf_config["vocab_size"]
    rng = random.Random(args.seed)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_len)]
    engine = build_engine_core(config, engine_core_plans(config, [0], clients=[], coordinator=None)[0])
    forward_ms(engine, prompt, 16)  # warm up
    layers = {"forward": forward_ms(engine, prompt, args.tokens),
              "engine": engine_step_ms(engine, prompt, args.tokens)}
    engine.shutdown()
    mp_config = EngineArgs(model=args.model, kv_cache_memory_bytes=KV_BUDGET).create_config()
    layers["worker"], engine_only = worker_process_ms(mp_config, prompt, args.tokens)
    layers["served"] = served_ms(args.model, prompt, args.tokens)
    base = statistics.median(layers["forward"])
    print(f"{config.model.model}, prompt {args.prompt_len}, {args.tokens} tokens, {torch.get_num_threads()} threads")
    for name, times in layers.items():
        median = statistics.median(times)
        print(f"  {name:8s} median {median:7.2f} ms/token  ({median / base:.3f}x the forward)")
    print(f"  the worker waits for its next step (the engine's own work): median {statistics.median(engine_only):.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
