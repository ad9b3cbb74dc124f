"""Replica choice: least-loaded (own counts corrected by published loads),
cache-aware (the replica holding the longest prefix, unless it is too busy;
prefixes that other API servers sent arrive with the published loads) and
round-robin."""
from __future__ import annotations

import pytest

from fleet.config.cache import CacheConfig
from fleet.config.fleet import FleetConfig
from fleet.config.parallel import ParallelConfig
from fleet.core.messages import EngineLoads
from fleet.frontend.load_balancer import LoadBalancer, imbalanced, routing_balancer
from fleet.frontend.prefix_index import prompt_block_hashes


def test_equal_loads_rotate_and_unequal_pick_the_least_loaded():
    balancer = LoadBalancer([0, 1, 2])
    assert [balancer.pick() for _ in range(3)] == [0, 1, 2]
    balancer.finished(1)
    assert balancer.pick() == 1
    assert balancer.estimates() == [1, 1, 1]


def test_published_loads_of_other_api_servers_steer_requests_away():
    balancer = LoadBalancer([0, 1])
    balancer.publish(EngineLoads(num_waiting=[3, 0], num_running=[2, 1]))  # others keep engine 0 busy
    assert [balancer.pick() for _ in range(4)] == [1, 1, 1, 1]
    assert balancer.estimates() == [5, 5]


def test_own_requests_count_even_before_the_engines_report_them():
    balancer = LoadBalancer([0, 1])
    for _ in range(4):
        balancer.pick()
    balancer.publish(EngineLoads(num_waiting=[0, 0], num_running=[0, 0]))  # a stale table
    assert balancer.estimates() == [2, 2]


def test_a_hybrid_launch_reads_only_its_own_ranks():
    balancer = LoadBalancer([2, 3])
    balancer.publish(EngineLoads(num_waiting=[9, 9, 0, 4], num_running=[9, 9, 1, 0]))
    assert balancer.estimates() == [1, 4]
    assert balancer.pick() == 0


def test_the_sequences_of_one_prompt_count_together():
    balancer = LoadBalancer([0, 1])
    assert balancer.pick(num_requests=3) == 0
    assert balancer.pick() == 1
    assert balancer.pick() == 1
    balancer.finished(0, 3)
    assert balancer.estimates() == [0, 2]


def test_a_replica_that_is_down_gets_nothing_until_it_is_up():
    balancer = LoadBalancer([0, 1, 2])
    balancer.set_up(1, False)
    assert [balancer.pick() for _ in range(4)] == [0, 2, 0, 2]
    balancer.set_up(0, False)
    balancer.set_up(2, False)
    assert balancer.pick() is None
    balancer.set_up(1, True)
    assert balancer.pick() == 1


# ---------------------------------------------------------------- cache-aware

BLOCK = 4
SYSTEM = list(range(100, 100 + 3 * BLOCK))
"""A shared prefix of three full blocks."""


def cache_aware(dp_ranks: list[int] | None = None, kv_blocks: int = 64) -> tuple[LoadBalancer, list[str]]:
    """A cache-aware balancer of 4-token blocks, and the reasons of its picks."""
    reasons: list[str] = []
    dp_ranks = dp_ranks or [0, 1]
    balancer = LoadBalancer(dp_ranks, "cache-aware", BLOCK, [kv_blocks] * len(dp_ranks), reasons.append)
    return balancer, reasons


def test_requests_sharing_a_prefix_follow_it_to_its_replica_while_others_balance():
    balancer, reasons = cache_aware()
    assert balancer.pick(1, SYSTEM + [1, 2]) == 0  # nobody holds it: least loaded, first in rotation
    assert balancer.pick(1, [7] * 12) == 1  # another prompt balances
    assert balancer.pick(1, [8] * 12) == 0
    assert [balancer.pick(1, SYSTEM + [suffix]) for suffix in range(5)] == [0] * 5, "replica 0 holds the prefix"
    assert balancer.estimates() == [7, 1]
    assert reasons == ["least_loaded"] * 3 + ["prefix"] * 5


def test_the_longest_match_wins_and_equal_matches_go_to_the_least_loaded():
    balancer, reasons = cache_aware()
    balancer.pick(1, SYSTEM[:BLOCK])  # replica 0: the first block
    balancer.pick(1, SYSTEM)  # replica 0 again (one block matched): now all three
    balancer.pick(1, [9] * 8)  # replica 1
    balancer.pick(1, SYSTEM[:BLOCK] + [5] * 8)  # replica 0, where its first block is
    assert balancer.estimates() == [3, 1]
    # Let replica 1 hold the first block too: it ties with replica 0 on a prompt of two blocks, and is less loaded.
    balancer.publish(EngineLoads([0, 0], [0, 0], [[], prompt_hashes(SYSTEM[:BLOCK])]))
    assert balancer.pick(1, SYSTEM[:BLOCK] + [6] * 4) == 1
    assert balancer.pick(1, SYSTEM + [6]) == 0, "three blocks beat one"
    assert reasons[-2:] == ["prefix", "prefix"]


def test_a_replica_much_busier_than_the_least_loaded_loses_its_prefix():
    balancer, reasons = cache_aware()
    balancer.pick(1, SYSTEM)
    balancer.publish(EngineLoads([30, 0], [3, 0]))  # 33 on replica 0: past 32 more than replica 1, and 1.5 times
    assert balancer.pick(1, SYSTEM) == 1
    assert reasons[-1] == "imbalance"
    assert balancer.pick(1, SYSTEM) == 1, "replica 1 now holds it too, and is less loaded"
    balancer.publish(EngineLoads([30, 20], [3, 3]))  # 33 against 23: 1.43 times, not imbalanced
    assert balancer.pick(1, SYSTEM + [1]) == 1  # equal matches: the least loaded


def test_imbalance_needs_both_thresholds():
    assert imbalanced(33, 0) and imbalanced(100, 60)
    assert not imbalanced(32, 0), "not past the absolute threshold"
    assert not imbalanced(90, 60), "not past 1.5 times"


def test_a_prompt_shorter_than_a_block_or_no_prompt_goes_by_load():
    balancer, reasons = cache_aware()
    assert [balancer.pick(1, [1, 2, 3]), balancer.pick(1, [1, 2, 3]), balancer.pick()] == [0, 1, 0]
    assert reasons == ["least_loaded"] * 3


def test_what_other_api_servers_sent_arrives_with_the_published_loads():
    balancer, reasons = cache_aware([2, 3])  # a hybrid launch's ranks: EngineLoads are by rank
    relayed = [[], [], [], prompt_hashes(SYSTEM)]  # rank 3 took a request with this prompt from another API server
    balancer.publish(EngineLoads([0, 0, 0, 0], [0, 0, 0, 2], relayed))
    assert balancer.pick(1, SYSTEM + [4]) == 1
    assert reasons == ["prefix"]


def test_a_replica_that_went_down_forgets_its_prefixes_and_ignores_relays_until_up():
    balancer, reasons = cache_aware()
    balancer.pick(1, SYSTEM)
    balancer.set_up(0, False)
    assert balancer.pick(1, SYSTEM) == 1, "a replica down is never picked"
    balancer.publish(EngineLoads([0, 0], [0, 0], [prompt_hashes([5] * 8), []]))  # a late report from the dead one
    balancer.set_up(0, True)
    balancer.finished(0, 1)  # its request failed over
    assert [balancer.pick(1, [5] * 8), balancer.pick(1, SYSTEM)] == [0, 1], "the restarted replica starts empty"
    assert reasons == ["least_loaded", "least_loaded", "least_loaded", "prefix"]


def test_prefixes_beyond_a_replicas_kv_capacity_are_forgotten_oldest_first():
    balancer, reasons = cache_aware(kv_blocks=6)
    balancer.publish(EngineLoads([0, 0], [0, 0], [prompt_hashes(SYSTEM), []]))  # three blocks on replica 0
    balancer.publish(EngineLoads([0, 0], [0, 0], [prompt_hashes([7] * 8), []]))  # two more: five of six
    assert balancer.pick(1, SYSTEM) == 0
    balancer.publish(EngineLoads([0, 0], [0, 0], [prompt_hashes([8] * 16), []]))  # four more: three go
    balancer.finished(0)
    assert balancer.indexes[0].match(prompt_hashes(SYSTEM)) == 2, "[7] * 8's blocks went first, then SYSTEM's tail"
    assert balancer.pick(1, SYSTEM) == 0
    balancer.publish(EngineLoads([0, 0], [0, 0], [prompt_hashes([9] * 24), []]))  # six more: all else forgotten
    assert balancer.pick(1, SYSTEM) == 1
    assert reasons == ["prefix", "prefix", "least_loaded"]


def test_one_pick_hashes_at_most_the_largest_capacity():
    balancer, _ = cache_aware(kv_blocks=5)
    balancer.pick(1, list(range(400)))  # 100 blocks
    assert len(balancer.indexes[0]) == 5


# ---------------------------------------------------------------- round-robin


def test_round_robin_rotates_over_the_replicas_up_whatever_their_load():
    reasons: list[str] = []
    balancer = LoadBalancer([0, 1, 2], "round-robin", on_decision=reasons.append)
    balancer.publish(EngineLoads([9, 0, 0], [9, 0, 0]))
    assert [balancer.pick(1, SYSTEM) for _ in range(4)] == [0, 1, 2, 0]
    balancer.set_up(1, False)
    assert [balancer.pick() for _ in range(4)] == [2, 0, 2, 0]
    assert set(reasons) == {"round_robin"}


# ---------------------------------------------------------------- from the config


class FakeClient:
    """The part of EngineClient that routing_balancer uses."""

    def __init__(self, dp_ranks: list[int], num_blocks: list[int]):
        self.engine_identities = [rank.to_bytes(2, "little") for rank in dp_ranks]
        self.num_blocks = num_blocks
        self.calls: list[tuple[str, int]] = []

    def call_utility(self, method: str, *args, engine_index: int = 0, timeout: float = 30.0):
        self.calls.append((method, engine_index))
        return {"num_blocks": self.num_blocks[engine_index], "num_free_blocks": 0}


def config_with(routing: str = "cache-aware", prefix_caching: bool = True, block_size: int = 16) -> FleetConfig:
    parallel = ParallelConfig(data_parallel_size=2, data_parallel_routing=routing)
    return FleetConfig(parallel=parallel, cache=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching))


def test_cache_aware_routing_asks_each_engine_its_kv_capacity():
    client = FakeClient([0, 1], [100, 200])
    balancer = routing_balancer(config_with(block_size=8), client)
    assert (balancer.routing, balancer.block_size, balancer.dp_ranks) == ("cache-aware", 8, [0, 1])
    assert [index.capacity for index in balancer.indexes] == [100, 200]
    assert client.calls == [("kv_stats", 0), ("kv_stats", 1)]


@pytest.mark.parametrize("config,dp_ranks,routing", [
    (config_with(prefix_caching=False), [0, 1], "least-loaded"),
    (config_with(), [0], "least-loaded"),  # one engine (external load balancing): nothing to route
    (config_with("round-robin"), [0, 1], "round-robin"),
    (config_with("least-loaded"), [0, 1], "least-loaded"),
])
def test_other_routings_need_no_capacity(config, dp_ranks, routing):
    client = FakeClient(dp_ranks, [100] * len(dp_ranks))
    balancer = routing_balancer(config, client)
    assert balancer.routing == routing and balancer.indexes is None and client.calls == []


def prompt_hashes(token_ids: list[int]) -> list[bytes]:
    return prompt_block_hashes(token_ids, BLOCK)
