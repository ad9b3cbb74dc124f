"""Sockets, addresses and child processes: what every fleet process needs to
talk to its parent and its peers.

Children are started with `subprocess` (never multiprocessing, which would
pickle the process object); each one reads its typed start-up info from stdin,
dies with its parent (PR_SET_PDEATHSIG plus a parent watch), and reports
Ready or StartupFailed on the parent's handshake socket.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import msgspec
import psutil
import zmq

from fleet.core import serial
from fleet.core.messages import Handshake, Ready, StartupFailed

PR_SET_PDEATHSIG = 1


class StartupTimeout(RuntimeError):
    pass


class ChildFailed(RuntimeError):
    pass


class NodeMissing(RuntimeError):
    """Another node of a multi-node job did not join, or stopped answering; the message names it."""


def new_ipc_address(tag: str) -> str:
    """A fresh ipc:// path in a private directory (no port races)."""
    directory = os.environ.get("FLEET_IPC_DIR") or tempfile.gettempdir()
    return f"ipc://{directory}/fleet-{tag}-{uuid.uuid4().hex[:12]}.sock"


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent)."""
    probe = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((host, 9))
        return probe.getsockname()[0]
    finally:
        probe.close()


def bind_tcp(socket: zmq.Socket, host: str, port: int = 0) -> str:
    """Bind to host:port (0: any free port, never probed first) and return the address bound."""
    if port:
        socket.bind(f"tcp://{host}:{port}")
        return f"tcp://{host}:{port}"
    bound = socket.bind_to_random_port(f"tcp://{host}")
    return f"tcp://{host}:{bound}"


def make_socket(ctx: zmq.Context, kind: int, *, bind: str | None = None, connect: str | None = None, identity: bytes | None = None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PUSH, zmq.DEALER, zmq.ROUTER, zmq.PUB, zmq.XPUB):
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind in (zmq.PULL, zmq.DEALER, zmq.ROUTER, zmq.SUB):
        sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if bind:
        sock.bind(bind)
    if connect:
        sock.connect(connect)
    return sock


# ---- child side -------------------------------------------------------------------


def die_with_parent() -> None:
    """Ask the kernel to SIGKILL us when our parent dies, and watch it too
    (PDEATHSIG is Linux-only and misses a parent that died before the call)."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        except OSError:
            pass
    if os.getppid() != parent or parent == 1:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def read_startup_info(info_type: type) -> Any:
    """The typed start-up info the parent wrote to our stdin."""
    return msgspec.msgpack.decode(sys.stdin.buffer.read(), type=info_type)


def report(handshake_address: str, message: Ready | StartupFailed) -> None:
    ctx = zmq.Context.instance()
    sock = make_socket(ctx, zmq.PUSH, connect=handshake_address)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.send(serial.encode(message))
    sock.close()


# ---- parent side ------------------------------------------------------------------


class ChildProcess:
    """A child started by `spawn`: its name, Popen handle and liveness."""

    def __init__(self, name: str, popen: subprocess.Popen):
        self.name = name
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def describe_exit(self) -> str:
        code = self.popen.poll()
        if code is None:
            return f"{self.name} (pid {self.pid}) is running"
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        return f"{self.name} (pid {self.pid}) died ({how})"

    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def wait(self, timeout: float) -> None:
        """Until it exited, or `timeout` passed (no error either way)."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

def stop_all(children: list[ChildProcess], grace: float, terminate_now: bool = False) -> None:
    """Stop children together under one deadline: `grace` seconds to exit on
    their own (they were asked to), then SIGTERM, then SIGKILL 2 s later.
    Anything with alive/terminate/kill/wait stops alike (Ray actors too)."""
    for phase_timeout, action in ((0.0 if terminate_now else grace, None), (2.0, "terminate"), (1.0, "kill")):
        alive = [c for c in children if c.alive()]
        if not alive:
            return
        for child in alive:
            if action is not None:
                getattr(child, action)()
        deadline = time.monotonic() + phase_timeout
        for child in alive:
            child.wait(max(deadline - time.monotonic(), 0.0))


class ForeignProcess:
    """A process we did not start but depend on (an API server's engines)."""

    def __init__(self, name: str, pid: int):
        self.name = name
        self.pid = pid

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def describe_exit(self) -> str:
        return f"{self.name} (pid {self.pid}) " + ("is running" if self.alive() else "died")


def python_command(module: str, *args: str) -> list[str]:
    """`python -P -m module args...`: -P keeps the working directory off
    `sys.path`, so a child started in the checkout (whose top-level folders
    share names with packages on the index) imports only installed packages."""
    return [sys.executable, "-P", "-m", module, *args]


def spawn(module: str, name: str, info: Any, pass_fds: tuple[int, ...] = ()) -> ChildProcess:
    """Start `python -P -m module --name name` with `info` (msgspec) on its stdin.
    The name stands in the command line so `ps` shows what each process is."""
    popen = subprocess.Popen(
        python_command(module, "--name", name),
        stdin=subprocess.PIPE,
        pass_fds=pass_fds,
    )
    assert popen.stdin is not None
    popen.stdin.write(msgspec.msgpack.encode(info))
    popen.stdin.close()
    return ChildProcess(name, popen)


REPORT_MARGIN_S = 10.0
"""A parent waits this much longer than --distributed-timeout-seconds for its
children's start-up: a child that gives up on that timeout itself (a peer, a
store, a Ray placement) then still gets to say why."""


class HandshakeListener:
    """Collects Ready/StartupFailed from children, under one deadline."""

    def __init__(self, ctx: zmq.Context, tcp_host: str | None = None):
        """On ipc://, or on `tcp_host` (any free port) when processes of other nodes report here."""
        self._sock = make_socket(ctx, zmq.PULL)
        if tcp_host is None:
            self.address = new_ipc_address("handshake")
            self._sock.bind(self.address)
        else:
            self.address = bind_tcp(self._sock, tcp_host)
        self._decoder = serial.Decoder(Handshake, "handshake")

    def wait_all(self, children: list[ChildProcess], timeout: float, remote: list[str] = ()) -> dict[str, Ready]:
        """Ready of every child (and of the `remote` processes, which other
        nodes started), or raise naming who failed or did not answer."""
        ready: dict[str, Ready] = {}
        expected = [c.name for c in children] + list(remote)
        deadline = time.monotonic() + timeout + REPORT_MARGIN_S
        while len(ready) < len(expected):
            for child in children:
                if child.name not in ready and not child.alive():
                    raise ChildFailed(f"{child.describe_exit()} before it was ready")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [name for name in expected if name not in ready]
                raise StartupTimeout(f"no Ready within {timeout + REPORT_MARGIN_S:.0f} s from: {', '.join(missing)}")
            if self._sock.poll(min(100, int(remaining * 1000) + 1)):
                message = self._decoder.decode(self._sock.recv())
                if isinstance(message, StartupFailed):
                    raise ChildFailed(f"{message.name} (pid {message.pid}) failed to start: {message.error}")
                if isinstance(message, Ready):
                    ready[message.name] = message
        return ready

    def close(self) -> None:
        self._sock.close()
