"""Data-parallel replicas of a dense model behind `fleet launch`: independent
engine cores, least-loaded balancing, per-engine metrics (a replica's death:
test_replica_restarts.py)."""
from __future__ import annotations


import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import assert_greedy_over_http, metrics_of_every_api_server, per_engine

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M")


@pytest.fixture(scope="module")
def dense_dp2_server(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--dp", "2", "--api-server-count", "2", *TINY)
    yield server
    server.close()


def test_dense_dp2_gives_the_oracle_tokens_and_spreads_the_load(dense_dp2_server, tiny_llama_dir):
    server = dense_dp2_server
    assert len(server.children_named("fleet-engine-dp")) == 2
    assert len(server.children_named("fleet-dp-coordinator")) == 1
    bodies = assert_greedy_over_http(server, tiny_llama_dir, count=16, seed=7)
    assert {b["api_server"] for b in bodies} == {"0", "1"}, "both API servers answer on the shared port"
    finished = per_engine(metrics_of_every_api_server(server, 2), "fleet:request_success_total")
    assert sum(finished.values()) >= 16
    assert finished.get("0", 0) >= 3 and finished.get("1", 0) >= 3, finished
