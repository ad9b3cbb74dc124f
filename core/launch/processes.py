"""Child processes: how every fleet process is started, dies with its
parent, and reports its start-up.

Children are started with `subprocess` (never multiprocessing, which would
pickle the process object); each one reads its typed start-up info from stdin,
dies with its parent (PR_SET_PDEATHSIG plus a parent watch), and reports
Ready or StartupFailed on the parent's handshake socket. `child_main` and
`start_or_report` are that protocol, written once for every process module.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
import psutil
import zmq

from fleet.core import serial
from fleet.core.ipc import bind_tcp, make_socket, new_ipc_address
from fleet.core.messages import Handshake, Ready, StartupFailed

logger = logging.getLogger(__name__)

Info = TypeVar("Info")
Built = TypeVar("Built")

PR_SET_PDEATHSIG = 1


class StartupTimeout(RuntimeError):
    pass


class ChildFailed(RuntimeError):
    pass


class NodeMissing(RuntimeError):
    """Another node of a multi-node job did not join, or stopped answering; the message names it."""


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



def log_as(name: str) -> None:
    """This process's log lines, each naming the process (a child, a Ray actor or the launcher)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s {name} %(message)s")


def child_main(info_type: type[Info], body: Callable[[str, Info], None]) -> None:
    """The whole of a child process's main(): its name from `--name`,
    logging that names it, death with its parent, its typed start-up info
    from stdin, then `body(name, info)`."""
    name = sys.argv[sys.argv.index("--name") + 1]
    log_as(name)
    die_with_parent()
    body(name, read_startup_info(info_type))


def start_or_report(name: str, handshake_address: str, build: Callable[[], Built]) -> Built:
    """`build()`, or, when it raises, the error logged and reported to the
    parent as StartupFailed (which names us) and this process ended."""
    try:
        return build()
    except Exception as error:  # noqa: BLE001 - any start-up failure goes to the parent
        logger.exception("%s failed to start", name)
        report(handshake_address, StartupFailed(name, os.getpid(), f"{type(error).__name__}: {error}"))
        sys.exit(1)

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

    def release(self) -> None:
        """Free what it held beyond its process, once it died: nothing (the kernel freed it all)."""

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
        try:  # one handle, asked ten times a second: it also knows a later process given the same pid
            self._process: psutil.Process | None = psutil.Process(pid)
        except psutil.NoSuchProcess:
            self._process = None

    def alive(self) -> bool:
        try:
            return (self._process is not None and self._process.is_running()
                    and self._process.status() != psutil.STATUS_ZOMBIE)
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
            message = self.receive(min(100, int(remaining * 1000) + 1))
            if isinstance(message, StartupFailed):
                raise ChildFailed(f"{message.name} (pid {message.pid}) failed to start: {message.error}")
            if isinstance(message, Ready):
                ready[message.name] = message
        return ready

    def receive(self, timeout_ms: int) -> Ready | StartupFailed | None:
        """The next report, or None when none came within `timeout_ms`."""
        if not self._sock.poll(timeout_ms):
            return None
        return self._decoder.decode(self._sock.recv())

    def close(self) -> None:
        self._sock.close()
