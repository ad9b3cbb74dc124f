"""A launch's ipc:// sockets live in a directory of its own, removed when it
ends; one left by a launch that was killed goes when the next one starts."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import zmq

from fleet.config import env
from fleet.core import ipc


@pytest.fixture
def short_tmp_path():
    """A socket path has at most 107 bytes: pytest's tmp_path is too deep."""
    path = tempfile.mkdtemp(prefix="fleet-test-")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


def test_the_directory_holds_the_sockets_and_goes_at_exit(short_tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_IPC_DIR", str(short_tmp_path))
    ctx = zmq.Context()
    try:
        with ipc.private_socket_dir() as path:
            assert env.ipc_dir() == path and os.path.dirname(path) == str(short_tmp_path)
            ipc.make_socket(ctx, zmq.PULL, bind=ipc.new_ipc_address("test"))
            assert len(os.listdir(path)) == 1
    finally:
        ctx.destroy(linger=0)
    assert env.ipc_dir() == str(short_tmp_path)
    assert os.listdir(short_tmp_path) == []


def test_a_killed_launchs_directory_is_removed_by_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("FLEET_IPC_DIR", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = tmp_path / f"{ipc.LAUNCH_DIR_PREFIX}{gone.stdout.strip()}-x1"
    abandoned.mkdir()
    (abandoned / "fleet-requests-0.sock").touch()
    running = tmp_path / f"{ipc.LAUNCH_DIR_PREFIX}{os.getpid()}-x2"  # a launch still running keeps its own
    running.mkdir()
    with ipc.private_socket_dir():
        assert not abandoned.exists() and running.exists()
