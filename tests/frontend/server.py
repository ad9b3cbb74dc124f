"""Run `fleet launch` as a real subprocess and talk to it over HTTP."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil

CHECKOUT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""Launches start here, as `make serve` does: the checkout's folder names must not shadow packages."""


class Server:
    """A `fleet launch` subprocess on a free port (the launcher binds port 0 and logs the URL)."""

    def __init__(self, *args: str, startup_timeout: float = 120.0, prefix: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, wait: bool = True, command: str = "launch"):
        """`prefix` runs the launcher under another command (`ip netns exec NS`);
        `wait=False` returns at once (call wait_ready later); `command`: launch or serve."""
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "fleet.frontend.cli", command, *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            cwd=CHECKOUT,
        )
        self._url_found = threading.Event()
        self.url = ""
        threading.Thread(target=self._read_log, daemon=True).start()
        self.descendants: list[psutil.Process] = []
        if wait:
            self.wait_ready(startup_timeout)

    def wait_ready(self, startup_timeout: float = 120.0) -> None:
        deadline = time.monotonic() + startup_timeout
        while not self._url_found.wait(0.2) and self.proc.poll() is None and time.monotonic() < deadline:
            pass
        if not self._url_found.is_set():
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.log[-40:]))
        self.descendants = psutil.Process(self.proc.pid).children(recursive=True)

    def _read_log(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            match = re.search(r"serving .* on (http://\S+|\(headless)", line)
            if match:
                self.url = match.group(1) if match.group(1).startswith("http") else ""
                self._url_found.set()

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def refresh_descendants(self) -> None:
        """Add the processes started since (a restarted replica's), so that stopping checks them too."""
        known = {p.pid for p in self.descendants}
        if self.proc.poll() is None:
            self.descendants += [p for p in psutil.Process(self.proc.pid).children(recursive=True) if p.pid not in known]

    def children_named(self, part: str) -> list[psutil.Process]:
        """The descendants running whose command line has `part`."""
        return [p for p in self.descendants if part in " ".join(_cmdline(p))]

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout)
        self.assert_nothing_left()
        return code

    def close(self) -> None:
        """Stop the server if it still runs (a test may have killed it) and check that nothing is left."""
        if self.proc.poll() is None:
            self.stop()
        self.assert_nothing_left()

    def kill(self) -> None:
        if self.proc.poll() is not None:  # already gone: nothing to kill but what it left
            for p in self.descendants:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
            return
        for p in [*psutil.Process(self.proc.pid).children(recursive=True), psutil.Process(self.proc.pid)]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()

    def assert_nothing_left(self, timeout: float = 10.0) -> None:
        _, alive = psutil.wait_procs(self.descendants, timeout=timeout)
        assert not alive, f"left behind: {[p.pid for p in alive]}"

    def openai_client(self):
        """The openai client, pointed at this server."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="unused")

    def get(self, path: str, **kwargs) -> httpx.Response:
        return httpx.get(self.url + path, **{"timeout": 60, **kwargs})

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, **{"timeout": 60, **kwargs})

    def metric(self, name: str) -> float:
        """Sum of a Prometheus metric over its label sets."""
        total = 0.0
        for line in self.get("/metrics").text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def wait_until(self, predicate, timeout: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.1)
        return predicate()


def _cmdline(process: psutil.Process) -> list[str]:
    try:
        return process.cmdline() if process.status() != psutil.STATUS_ZOMBIE else []
    except psutil.NoSuchProcess:
        return []


def health_fails(server: Server) -> bool:
    """/health answers anything but 200, or nothing at all."""
    try:
        return server.get("/health", timeout=2).status_code != 200
    except httpx.HTTPError:
        return True
