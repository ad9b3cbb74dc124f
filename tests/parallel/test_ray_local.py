"""A Ray backend with no cluster to join (no RAY_ADDRESS, no --ray-address):
the launch starts a local Ray cluster and takes it down when it stops."""
from __future__ import annotations

import psutil
import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import assert_greedy_over_http

pytest.importorskip("ray", reason="the Ray tests need `pip install fleet[ray]` (make install-test does it)")

pytestmark = pytest.mark.slow


def test_a_launch_without_a_cluster_starts_its_own(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    server = Server(tiny_llama_dir, "--tp", "2", "--distributed-executor-backend", "ray", "--dtype", "float32",
                    "--device", "cpu", "--kv-cache-memory-bytes", "2M", startup_timeout=180)
    try:
        assert any("started for this launch" in line for line in server.log)
        assert any("raylet" in _cmdline(p) for p in server.descendants), "the local cluster runs under the launcher"
        assert_greedy_over_http(server, tiny_llama_dir, count=2, seed=43)
    finally:
        server.close()  # also proves the local cluster's processes are gone
    assert not [p for p in psutil.process_iter(["cmdline"]) if tiny_llama_dir in " ".join(p.info["cmdline"] or [])]


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:  # Ray starts short-lived helpers
        return ""

