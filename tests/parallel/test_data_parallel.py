"""Data-parallel replicas of a dense model behind `fleet launch`: independent
engine cores, least-loaded balancing of unrelated prompts, cache-aware routing
of prompts that share a prefix, per-engine metrics (a replica's death:
test_replica_restarts.py)."""
from __future__ import annotations

import random
import re
import time

import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.parallel.dp_helpers import (
    assert_greedy_over_http,
    complete_concurrently,
    expected_texts,
    metrics_of_every_api_server,
    per_engine,
)

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


def test_prompts_sharing_a_prefix_meet_on_one_replica_whichever_api_server_routes_them(dense_dp2_server,
                                                                                       tiny_llama_dir):
    """Cache-aware routing (the default): once one request with a prefix of four
    blocks ran, the others that share it go to the same replica and find it in
    its prefix cache, those that the other API server takes too (it learns what
    was sent where from the engines, through the DP coordinator)."""
    server = dense_dp2_server
    rng = random.Random(11)
    prefix = [rng.randrange(3, 512) for _ in range(4 * 16)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(5)] for _ in range(25)]
    before = metrics_of_every_api_server(server, 2)
    bodies = complete_concurrently(server, prompts[:1])
    time.sleep(0.5)  # its engine's report reaches the other API server within the coordinator's 20 ms batching
    for batch in range(1, len(prompts), 6):  # until both API servers took some
        bodies += complete_concurrently(server, prompts[batch:batch + 6])
        if {b["api_server"] for b in bodies[1:]} == {"0", "1"}:
            break
    assert {b["api_server"] for b in bodies[1:]} == {"0", "1"}, "both API servers routed the prefix's followers"
    sent = prompts[:len(bodies)]
    assert [b["choices"][0]["text"] for b in bodies] == expected_texts(server, tiny_llama_dir, sent)
    after = metrics_of_every_api_server(server, 2)
    finished = growth(per_engine(before, "fleet:request_success_total"), per_engine(after, "fleet:request_success_total"))
    assert sorted(finished.values()) == [0, len(sent)], f"all on one replica: {finished}"
    (replica,) = [engine for engine, count in finished.items() if count]
    hits = growth(per_engine(before, "fleet:prefix_cache_hits_total"), per_engine(after, "fleet:prefix_cache_hits_total"))
    assert hits[replica] >= (len(sent) - 1) * len(prefix), hits
    prefix_picks = decisions(after, "prefix") - decisions(before, "prefix")
    assert prefix_picks == len(sent) - 1, "the API server that did not send the first knew where its prefix went"


def growth(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {engine: after.get(engine, 0.0) - before.get(engine, 0.0) for engine in ("0", "1")}


def decisions(pages: dict[str, str], reason: str) -> float:
    """fleet:routing_decisions_total of `reason`, summed over API servers."""
    pattern = rf'^fleet:routing_decisions_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$'
    return sum(float(m.group(1)) for text in pages.values() for m in re.finditer(pattern, text, re.MULTILINE))
