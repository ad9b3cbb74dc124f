"""What hostile requests cost a real launch of the default model (issue 31's
cases), and how long a small chat waits while large n requests run.

    python -P scripts/bench_request_limits.py [--launch-args "extra fleet launch flags"]

Starts `fleet launch --kv-cache-memory-bytes 512M --trust-request-chat-template`,
then prints for each hostile request its status and seconds, and the API
server's RSS and CPU after all of them; then sends four `n=64,
max_tokens=2048` completions and, while they run, a 4-token chat from
another client, and prints that chat's latency and the big requests' progress.
"""
from __future__ import annotations

import argparse
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil

LAUNCH = ["--kv-cache-memory-bytes", "512M", "--trust-request-chat-template"]
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def chained_grammar(rules: int) -> str:
    lines = ["start: r0"] + [f'r{i}: "t{i}" r{i + 1}?' for i in range(rules - 1)] + [f'r{rules - 1}: "t{rules - 1}"']
    return "\n".join(lines)


HOSTILE = {
    "'a' * 10**9 in a template": {**CHAT, "chat_template": "{{ 'a' * 10**9 }}"},
    "99999 x 99999 loops in a template": {**CHAT, "chat_template": (
        "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x")},
    "3,000-rule chained Lark grammar": {**CHAT, "structured_outputs": {"grammar": chained_grammar(3000)}},
    "50,000 choices": {**CHAT, "structured_outputs": {"choice": [f"option {i}" for i in range(50000)]}},
    "(a{1000}){1000}": {**CHAT, "structured_outputs": {"regex": "(a{1000}){1000}"}},
    "self-referencing $ref": {**CHAT, "structured_outputs": {"json": {"$ref": "#"}}},
    "5,000 tools, tool_choice required": {**CHAT, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(5000)]},
}


def launch(extra: list[str]) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", "--port", "0", *LAUNCH, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        match = re.search(r"serving .* on (http://\S+)", line)
        if match:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, match.group(1)
    raise RuntimeError("fleet launch did not start")


def api_server(proc: subprocess.Popen) -> psutil.Process:
    return next(p for p in psutil.Process(proc.pid).children(recursive=True) if "fleet-api-0" in " ".join(p.cmdline()))


def hostile_requests(url: str, api: psutil.Process) -> None:
    rss_before = api.memory_info().rss
    for name, body in HOSTILE.items():
        started = time.monotonic()
        response = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        message = response.json().get("error", {}).get("message", "")[:90]
        print(f"{name:36s} {response.status_code} in {time.monotonic() - started:5.2f} s  {message}")
    api.cpu_percent()
    time.sleep(1.0)
    print(f"API server: alive {api.is_running()}, RSS {rss_before / 2**20:.0f} -> {api.memory_info().rss / 2**20:.0f} "
          f"MiB, CPU over the next second {api.cpu_percent():.0f} %")


def small_chat_beside_large_requests(url: str) -> None:
    big = {"prompt": "Write a long story about a lighthouse.", "n": 64, "max_tokens": 2048, "ignore_eos": True}
    threads = [threading.Thread(target=_post_ignoring_errors, args=(url + "/v1/completions", big), daemon=True)
               for _ in range(4)]
    for thread in threads:
        thread.start()
    time.sleep(5.0)  # the big requests fill the batch
    started = time.monotonic()
    response = httpx.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 4}, timeout=600)
    waited = time.monotonic() - started
    metrics = httpx.get(url + "/metrics").text
    running = re.search(r"^fleet:num_requests_running\S* (\S+)", metrics, re.M)
    print(f"4-token chat beside 4 x (n=64, max_tokens=2048): {response.status_code} in {waited:.2f} s "
          f"({running.group(1) if running else '?'} sequences running)")


def _post_ignoring_errors(url: str, body: dict) -> None:
    try:
        httpx.post(url, json=body, timeout=3600)
    except httpx.HTTPError:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launch-args", default="", help="more `fleet launch` flags, as one shell-quoted string")
    args = parser.parse_args()
    proc, url = launch(shlex.split(args.launch_args))
    try:
        hostile_requests(url, api_server(proc))
        small_chat_beside_large_requests(url)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


if __name__ == "__main__":
    main()
