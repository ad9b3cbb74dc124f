"""A `fleet launch` child process, as the benchmarks in scripts/ drive one:
started with free ports, its URL read from its log, its log kept, its
Prometheus counters summed, and stopped with SIGTERM (which ends its whole tree)."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading

import httpx

SERVING = re.compile(r"serving .* on (http://\S+)")
"""The launcher's line once every process is ready."""


class LaunchedServer:
    def __init__(self, launch_args: list[str]):
        command = [sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", "--port", "0", *launch_args]
        self.proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        self.url = ""
        for line in self.proc.stdout:
            self.log.append(line)
            match = SERVING.search(line)
            if match:
                self.url = match.group(1)
                break
        if not self.url:
            raise RuntimeError("fleet launch did not start:\n" + "".join(self.log[-30:]))
        threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True).start()

    def metric(self, name: str) -> float:
        """The sum of a counter or gauge over all its labels (per-engine ones included)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)
