"""Replica soak: SIGKILL a random replica's engine core or worker every
--interval seconds under steady streaming load, and measure what the
clients saw (issue 28).

    python -P scripts/bench_replica_restarts.py [--duration 600] [--interval 60] [--clients 8]
                                                [--max-tokens 64] [--launch-args "extra fleet launch flags"]

Starts `fleet launch --dp 2 --kv-cache-memory-bytes 256M --max-replica-restarts 1000` (the default
model unless --launch-args names another), runs --clients streaming
clients in a loop, and kills a random process of a random replica every
--interval seconds for --duration seconds. Prints: requests completed,
retried (fleet:requests_retried_total), failed (an error event: they had
streamed tokens when their replica died; anything else counts as
unexpected), TTFT p50/p99 in the windows before each kill, while the
replica was down, and after it came back, and each restart's time (death
to Ready, from the launcher's log). Exits 1 on an unexpected failure.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import shlex
import statistics
import sys
import threading
import time
from dataclasses import dataclass

import httpx
import psutil

from fleet.frontend.launched_server import LaunchedServer

LAUNCH = ["--dp", "2", "--kv-cache-memory-bytes", "256M", "--max-replica-restarts", "1000"]
"""A kill a minute for ten minutes is past the default budget (5 restarts in 10 minutes), which would end the job."""
PROMPTS = ["Tell me about the sea.", "Write a short poem about trains.", "What is a data-parallel replica?",
           "List five fruits and their colours.", "Explain why the sky is blue.", "Describe a busy market."]


@dataclass
class Outcome:
    started: float
    ttft: float | None
    ok: bool
    error: str | None = None


class Launch(LaunchedServer):
    def __init__(self, extra: list[str]):
        super().__init__([*LAUNCH, *extra])

    def processes_of(self, dp_rank: int) -> list[psutil.Process]:
        """The engine core and workers of replica `dp_rank`."""
        names = (f"fleet-engine-dp{dp_rank}", f"fleet-worker-dp{dp_rank}-")
        return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                if any(name in " ".join(p.cmdline()) for name in names)]

    def replicas_up(self) -> bool:
        try:
            body = httpx.get(self.url + "/health?verbose", timeout=5).json()
        except httpx.HTTPError:
            return False
        return all(replica["state"] == "up" for replica in body["replicas"])


def client_loop(url: str, max_tokens: int, stop: threading.Event, outcomes: list[Outcome]) -> None:
    rng = random.Random()
    while not stop.is_set():
        body = {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}], "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True}
        start = time.monotonic()
        outcome = Outcome(start, None, False)
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
                if response.status_code != 200:
                    outcome.error = f"HTTP {response.status_code}"
                for line in response.iter_lines() if response.status_code == 200 else ():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        outcome.error = event["error"]["message"]
                        break
                    if outcome.ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                        outcome.ttft = time.monotonic() - start
                else:
                    outcome.ok = outcome.error is None
        except httpx.HTTPError as error:
            outcome.error = f"{type(error).__name__}: {error}"
        outcomes.append(outcome)


def percentiles(values: list[float]) -> str:
    if len(values) < 2:
        return f"n={len(values)}"
    cuts = statistics.quantiles(values, n=100)
    return f"p50 {statistics.median(values):.2f} s, p99 {cuts[98]:.2f} s (n={len(values)})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--launch-args", default="", help="extra `fleet launch` flags, one shell-quoted string")
    args = parser.parse_args()

    launch = Launch(shlex.split(args.launch_args))
    outcomes: list[Outcome] = []
    stop = threading.Event()
    threads = [threading.Thread(target=client_loop, args=(launch.url, args.max_tokens, stop, outcomes), daemon=True)
               for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    kills: list[tuple[float, float | None, str]] = []  # (killed at, back at, which)
    rng = random.Random(0)
    began = time.monotonic()
    try:
        while time.monotonic() - began + args.interval <= args.duration:
            time.sleep(args.interval)
            if launch.proc.poll() is not None:
                print("the launch ended:\n" + "".join(launch.log[-10:]))
                break
            victim = rng.choice(launch.processes_of(rng.randrange(2)))
            name = re.search(r"--name (\S+)", " ".join(victim.cmdline())).group(1)
            killed_at = time.monotonic()
            victim.kill()
            time.sleep(0.5)
            deadline = killed_at + 120
            while not launch.replicas_up() and time.monotonic() < deadline:
                time.sleep(0.1)
            back = time.monotonic() if launch.replicas_up() else None
            kills.append((killed_at, back, name))
            print(f"killed {name} at {killed_at - began:.0f} s; "
                  + (f"replica serves again after {back - killed_at:.1f} s" if back else "not back in 120 s"), flush=True)
        stop.set()
        for thread in threads:
            thread.join(300)
        retried = launch.metric("fleet:requests_retried_total") if launch.proc.poll() is None else float("nan")
    finally:
        if launch.proc.poll() is None:
            launch.stop()
    return report(outcomes, kills, retried, launch.log)


def report(outcomes: list[Outcome], kills: list[tuple[float, float | None, str]], retried: float,
           log: list[str]) -> int:
    failed = [o for o in outcomes if not o.ok]
    expected = [o for o in failed if o.error and "died while this request ran" in o.error]
    unexpected = [o for o in failed if o not in expected]
    print(f"\nrequests completed {sum(o.ok for o in outcomes)}, retried on another replica {retried:.0f}, "
          f"failed mid-stream {len(expected)}, failed otherwise {len(unexpected)}")
    for outcome in unexpected[:5]:
        print(f"  unexpected: {outcome.error}")
    edges = [0.0] + [k[0] for k in kills] + [float("inf")]
    for index, (killed_at, back, name) in enumerate(kills):
        before = [o.ttft for o in outcomes if edges[index] <= o.started < killed_at and o.ttft is not None]
        end = back or killed_at
        during = [o.ttft for o in outcomes if killed_at <= o.started < end and o.ttft is not None]
        after = [o.ttft for o in outcomes if end <= o.started < edges[index + 2] and o.ttft is not None]
        print(f"kill {index + 1} ({name}): TTFT before {percentiles(before)}; while down {percentiles(during)}; "
              f"after {percentiles(after)}")
    restarts = [float(m.group(1)) for line in log if (m := re.search(r"serves again ([\d.]+) s after it died", line))]
    if restarts:
        print("restart times (death to Ready, launcher's log): " + ", ".join(f"{t:.1f} s" for t in restarts))
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())
