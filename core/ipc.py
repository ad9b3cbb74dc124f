"""Sockets and addresses: how fleet processes reach each other over ZMQ
(ipc:// paths on one node, tcp:// between nodes). Starting, watching and
stopping the processes themselves is core/launch/processes.py."""
from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import zmq

from fleet.config import env


def new_ipc_address(tag: str) -> str:
    """A fresh ipc:// path in a private directory (no port races)."""
    directory = env.ipc_dir()
    return f"ipc://{directory}/fleet-{tag}-{uuid.uuid4().hex[:12]}.sock"


LAUNCH_DIR_PREFIX = "fleet-launch-"


@contextmanager
def private_socket_dir() -> Iterator[str]:
    """A directory for this launch's ipc:// socket files, in FLEET_IPC_DIR
    (default: the system's temporary directory), removed at exit; the
    launch's children find it in FLEET_IPC_DIR. Directories of launches
    that were killed before they could remove theirs go first."""
    parent = env.ipc_dir()
    _remove_abandoned(parent)
    path = tempfile.mkdtemp(prefix=f"{LAUNCH_DIR_PREFIX}{os.getpid()}-", dir=parent)
    try:
        with env.ipc_dir_set_to(path):
            yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_abandoned(parent: str) -> None:
    """Remove the socket directories of launches whose process is gone."""
    pattern = re.compile(rf"{re.escape(LAUNCH_DIR_PREFIX)}(\d+)-")
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = pattern.match(name)
        if match and not psutil.pid_exists(int(match.group(1))):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


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


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP socket, bound once by the launcher and shared by every API server."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.set_inheritable(True)
    return sock
