"""Soak: does `fleet launch` come out of minutes of mixed abuse as it went in?

    python -P scripts/soak.py [--duration 300] [--clients 64] [--port 8124] [-- extra launch flags]

Starts `fleet launch` (the default model unless the extra flags say
otherwise, with --kv-cache-memory-bytes 256M unless they set it), warms it
up, takes a baseline, then runs --clients concurrent clients for --duration
seconds. Each client loops over a random mix of:

- normal: a completion, or a streamed chat completion, read to the end (200);
- bad: a request the server must refuse (400/404/413), from out-of-vocabulary
  logit_bias to lone surrogates, huge integers, n too large and broken JSON;
- cancel: a stream closed by the client after its first events;
- disconnect: a non-streaming request whose client gives up after a moment.

It then waits for the server to go quiet and prints, per process, the RSS at
the baseline and at the end, and checks: the same process tree, every RSS
within 10 % of the baseline, no requests tracked by the API servers, none
running or waiting, no KV blocks in use, and no unexpected answer (a 5xx, a
bad request that was not refused, a normal one that failed). Exits 1 when a
check fails.

The warm-up first sends unique prompts that fill the KV cache 1.25 times
over: the cache is mapped at start and becomes resident as blocks are first
used, and freed blocks go to the back of the free queue (to keep prefix-cache
hits), so until every block was used once a worker's RSS grows without a leak.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx
import psutil

WORDS = [c + v for c in "bcdfghklmnprstvz" for v in "aeiou"]
RSS_TOLERANCE = 0.10
WARMUP_MIX_S = 30.0
QUIET_TIMEOUT_S = 30.0
KIND_WEIGHTS = {"normal": 5, "bad": 3, "cancel": 1, "disconnect": 1}
QUIET_METRICS = ("fleet:api_server_tracked_requests", "fleet:num_requests_running", "fleet:num_requests_waiting",
                 "fleet:kv_cache_usage_perc")


def bad_requests(model: str) -> list[tuple[str, str, bytes, set[int]]]:
    """(label, route, body, statuses the server may answer)."""
    def body(fields: dict) -> bytes:
        return json.dumps({"model": model, **fields}).encode()

    completion = {"prompt": "Hi", "max_tokens": 4}
    return [
        ("logit_bias out of vocabulary", "/v1/completions",
         body({**completion, "logit_bias": {"100000000": 5}}), {400}),
        ("logit_bias NaN", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 4, "logit_bias": {"5": NaN}}', {400}),
        ("stop_token_ids out of vocabulary", "/v1/completions",
         body({**completion, "stop_token_ids": [10**9], "min_tokens": 2}), {400}),
        ("seed 2^64", "/v1/completions", body({**completion, "seed": 2**64}), {400}),
        ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800", "max_tokens": 4}', {400}),
        ("n too large", "/v1/completions", body({**completion, "n": 100000}), {400}),
        ("prompt longer than the model", "/v1/completions", body({"prompt": "hi " * 20000, "max_tokens": 4}), {400}),
        ("unknown model", "/v1/completions", json.dumps({"model": "nope", **completion}).encode(), {404}),
        ("broken JSON", "/v1/completions", b'{"prompt": "Hi", ', {400}),
        ("wrong type", "/v1/chat/completions", body({"messages": "hello"}), {400}),
        ("image content part", "/v1/chat/completions",
         body({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}), {400}),
        ("detokenize -1", "/detokenize", body({"tokens": [-1]}), {400}),
        ("body over the limit", "/v1/completions", b'{"prompt": "' + b"a" * (8 * 2**20 + 1024) + b'"}', {413}),
    ]


@dataclass
class Tally:
    by_kind: Counter = field(default_factory=Counter)
    unexpected: list[str] = field(default_factory=list)

    def wrong(self, what: str) -> None:
        self.by_kind["unexpected"] += 1
        if len(self.unexpected) < 10:
            self.unexpected.append(what)


class Soak:
    def __init__(self, url: str, model: str, clients: int, mix: dict[str, int]):
        self.mix = mix
        self.url = url
        self.model = model
        self.clients = clients
        self.refusals = bad_requests(model)
        self.tally = Tally()

    def prompt(self, rng: random.Random) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))

    async def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=self.clients * 2, max_keepalive_connections=self.clients)
        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as http:
            await asyncio.gather(*(self.client(http, index, deadline) for index in range(self.clients)))

    async def client(self, http: httpx.AsyncClient, index: int, deadline: float) -> None:
        rng = random.Random(index)
        kinds, weights = list(self.mix), list(self.mix.values())
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                await getattr(self, kind)(http, rng)
                self.tally.by_kind[kind] += 1
            except httpx.TransportError as error:
                self.tally.wrong(f"{kind}: {type(error).__name__}: {error}")

    async def normal(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        max_tokens = rng.randint(1, 24)
        if rng.random() < 0.5:
            body = {"model": self.model, "prompt": self.prompt(rng), "max_tokens": max_tokens,
                    "temperature": rng.choice([0.0, 0.8])}
            response = await http.post("/v1/completions", json=body)
            if response.status_code != 200 or not response.json()["choices"]:
                self.tally.wrong(f"completion: {response.status_code} {response.text[:200]}")
            return
        body = {"model": self.model, "messages": [{"role": "user", "content": self.prompt(rng)}],
                "max_tokens": max_tokens, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            events = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        if response.status_code != 200 or not events or events[-1] != "data: [DONE]" or '"error"' in events[-2]:
            self.tally.wrong(f"chat stream: {response.status_code} {events[-2:]}")

    async def bad(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        label, route, body, allowed = rng.choice(self.refusals)
        response = await http.post(route, content=body, headers={"content-type": "application/json"})
        if response.status_code not in allowed or "error" not in response.json():
            self.tally.wrong(f"bad ({label}): {response.status_code} {response.text[:200]}")

    async def cancel(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": self.prompt(rng), "max_tokens": 200, "stream": True, "ignore_eos": True}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen >= rng.randint(1, 3):
                    break  # leaving the block closes the connection mid-stream

    async def disconnect(self, http: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"model": self.model, "prompt": self.prompt(rng), "max_tokens": 200, "ignore_eos": True}
        try:
            await http.post("/v1/completions", json=body, timeout=rng.uniform(0.2, 2.0))
        except httpx.TimeoutException:
            pass  # the client gave up: the server must notice and abort


# ---- the server -----------------------------------------------------------------------------


class Launch:
    def __init__(self, port: int, extra: list[str]):
        if not any(flag.startswith("--kv-cache-memory-bytes") for flag in extra):
            extra = [*extra, "--kv-cache-memory-bytes", "256M"]
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", "--port", str(port), *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        self.log: list[str] = []
        threading.Thread(target=self._read_log, daemon=True).start()

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def wait_ready(self, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("fleet launch exited:\n" + "".join(self.log[-30:]))
            if any("serving " in line for line in self.log):
                return
            time.sleep(0.2)
        raise RuntimeError("fleet launch did not get ready in time")

    def kv_tokens(self) -> int:
        """The KV cache of every engine, in tokens, as the launcher logged it."""
        return sum(int(m.group(1)) for line in self.log if (m := re.search(r"KV cache (\d+) tokens", line)))

    def tree(self) -> dict[int, psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return {p.pid: p for p in [root, *root.children(recursive=True)]}

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def wait_quiet(self) -> dict[str, float]:
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        while True:
            values = {name: self.metric(name) for name in QUIET_METRICS}
            if not any(values.values()) or time.monotonic() > deadline:
                return values
            time.sleep(0.5)

    def stop(self) -> list[int]:
        """SIGTERM, wait, and the PIDs left behind (none, we hope)."""
        processes = list(self.tree().values()) if self.proc.poll() is None else []
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
        _, alive = psutil.wait_procs(processes, timeout=10)
        return [p.pid for p in alive]


def process_label(process: psutil.Process) -> str:
    command = process.cmdline()
    if "--name" in command:
        return command[command.index("--name") + 1]
    return "fleet launch" if "launch" in command else " ".join(command)[:40]


def rss_of(tree: dict[int, psutil.Process]) -> dict[int, int]:
    return {pid: p.memory_info().rss for pid, p in tree.items()}


class RSSSampler:
    """Prints the RSS of every process every `interval` seconds during the
    soak: a leak climbs from sample to sample, allocator warm-up levels off."""

    def __init__(self, tree: dict[int, psutil.Process], interval: float):
        self.tree = tree
        self.interval = interval
        self.started = time.monotonic()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                rss = rss_of(self.tree)
            except psutil.NoSuchProcess:
                return
            sizes = ", ".join(f"{process_label(self.tree[pid])} {size / 2**20:.0f}" for pid, size in rss.items())
            print(f"  {time.monotonic() - self.started:4.0f} s: RSS MiB {sizes}", flush=True)

    def stop(self) -> None:
        self._stopped.set()


def fill_kv_cache(launch: Launch, model: str, clients: int) -> None:
    """Unique prompts, 1.25 times the cache's tokens in all, so that every
    block has been used once; sent `clients` at a time, so that steps also
    reach their largest shapes (a worker's heap keeps its high-water mark)."""
    rng = random.Random(1234)
    count = int(launch.kv_tokens() * 1.25 / 600) + 1  # 400 words are about 600 tokens
    prompts = [" ".join(rng.choice(WORDS) for _ in range(400)) for _ in range(count)]

    async def send_all() -> None:
        limits = httpx.Limits(max_connections=clients)
        async with httpx.AsyncClient(base_url=launch.url, timeout=600, limits=limits) as http:
            responses = await asyncio.gather(*(
                http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1})
                for prompt in prompts
            ))  # fmt: skip
        for response in responses:
            response.raise_for_status()

    asyncio.run(send_all())


def parse_mix(text: str) -> dict[str, int]:
    mix = {kind: int(weight) for kind, _, weight in (part.partition("=") for part in text.split(","))}
    unknown = set(mix) - set(KIND_WEIGHTS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown kinds {sorted(unknown)}: choose from {sorted(KIND_WEIGHTS)}")
    return mix


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=300.0, help="seconds of soak (default 300)")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--mix", type=parse_mix, default=KIND_WEIGHTS,
                        help="weights of the kinds of request (default normal=5,bad=3,cancel=1,disconnect=1)")
    args, extra = parser.parse_known_args()
    extra = [flag for flag in extra if flag != "--"]

    launch = Launch(args.port, extra)
    try:
        launch.wait_ready()
        model = httpx.get(launch.url + "/v1/models", timeout=30).json()["data"][0]["id"]
        started = time.monotonic()
        fill_kv_cache(launch, model, args.clients)
        asyncio.run(Soak(launch.url, model, args.clients, KIND_WEIGHTS).run(WARMUP_MIX_S))
        launch.wait_quiet()
        print(f"warm-up: {time.monotonic() - started:.0f} s (KV cache of {launch.kv_tokens()} tokens filled once)")
        tree_before = launch.tree()
        rss_before = rss_of(tree_before)

        soak = Soak(launch.url, model, args.clients, args.mix)
        started = time.monotonic()
        sampler = RSSSampler(tree_before, interval=args.duration / 5)
        asyncio.run(soak.run(args.duration))
        sampler.stop()
        soaked = time.monotonic() - started
        quiet = launch.wait_quiet()
        tree_after = launch.tree()
        rss_after = rss_of(tree_after)
        return report(soak.tally, soaked, args.clients, quiet, tree_before, rss_before, tree_after, rss_after, launch)
    finally:
        left = launch.stop()
        print(f"after SIGTERM: {len(left)} processes left behind {left if left else ''}")


def report(tally: Tally, seconds: float, clients: int, quiet: dict[str, float], tree_before: dict, rss_before: dict,
           tree_after: dict, rss_after: dict, launch: Launch) -> int:
    failures = []
    requests = sum(count for kind, count in tally.by_kind.items() if kind != "unexpected")
    print(f"soak: {seconds:.0f} s, {clients} clients, {requests} requests "
          f"({', '.join(f'{kind} {count}' for kind, count in sorted(tally.by_kind.items()))})")
    for line in tally.unexpected:
        print(f"  unexpected: {line}")
    if tally.by_kind["unexpected"]:
        failures.append(f"{tally.by_kind['unexpected']} unexpected answers")
    print("process                        RSS baseline    RSS end   change")
    for pid, process in sorted(tree_before.items()):
        before, after = rss_before[pid], rss_after.get(pid)
        if after is None:
            print(f"{process_label(process):<30} {before / 2**20:9.1f} MiB       gone")
            continue
        change = (after - before) / before
        print(f"{process_label(process):<30} {before / 2**20:9.1f} MiB {after / 2**20:7.1f} MiB {change:+7.1%}")
        if abs(change) > RSS_TOLERANCE:
            failures.append(f"{process_label(process)} RSS changed {change:+.1%}")
    if set(tree_before) != set(tree_after):
        failures.append(f"process tree changed: {sorted(tree_before)} -> {sorted(tree_after)}")
    print("at the end: " + ", ".join(f"{name.removeprefix('fleet:')} {value:g}" for name, value in quiet.items()))
    if any(quiet.values()):
        failures.append(f"not quiet after {QUIET_TIMEOUT_S:.0f} s: {quiet}")
    if launch.proc.poll() is not None:
        failures.append(f"fleet launch exited with {launch.proc.returncode}")
    print("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
