"""The DP coordinator's load table, as pure logic: the latest queue of each
engine, and the prompt blocks engines took (for cache-aware routing by
several API servers), passed on once."""
from __future__ import annotations

import pytest

from fleet.config.cache import CacheConfig
from fleet.config.fleet import FleetConfig
from fleet.config.parallel import ParallelConfig
from fleet.core.launch.dp_coordinator import LoadTable, relays_prompt_blocks
from fleet.core.launch.node_plan import ClientAddresses, CoordinatorAddresses, EngineCorePlan
from fleet.core.messages import EngineLoad, EngineLoads
from fleet.core.serial import Decoder, encode


def test_the_table_holds_each_engines_latest_queue():
    table = LoadTable(num_engines=2)
    table.update(EngineLoad(1, num_waiting=3, num_running=2))
    table.update(EngineLoad(1, num_waiting=1, num_running=2))
    assert table.publication() == EngineLoads([0, 1], [0, 2])


def test_prompt_blocks_are_published_once_by_rank_in_the_order_taken():
    table = LoadTable(num_engines=3)
    table.update(EngineLoad(2, 1, 0, [b"a1", b"a2"]))
    table.update(EngineLoad(0, 1, 0, [b"b1"]))
    table.update(EngineLoad(2, 2, 0, [b"c1"]))
    assert table.publication() == EngineLoads([1, 0, 2], [0, 0, 0], [[b"b1"], [], [b"a1", b"a2", b"c1"]])
    assert table.publication() == EngineLoads([1, 0, 2], [0, 0, 0]), "passed on already"


def test_a_load_without_blocks_decodes_as_before():
    """An EngineLoad or EngineLoads that leaves out the new field (every message
    of a job without cache-aware routing by several API servers) means none."""
    load = Decoder(EngineLoad, "test").decode(encode(EngineLoad(0, 1, 2)))
    assert load.new_prompt_blocks == []
    loads = Decoder(EngineLoads, "test").decode(encode(EngineLoads([1], [2], [[b"x" * 32]])))
    assert loads.new_prompt_blocks == [[b"x" * 32]]


def engine_plan(num_clients: int, coordinator: bool = True) -> EngineCorePlan:
    clients = [ClientAddresses(f"ipc://requests-{i}", f"ipc://outputs-{i}") for i in range(num_clients)]
    addresses = CoordinatorAddresses("ipc://in", "ipc://out", "ipc://loads") if coordinator else None
    return EngineCorePlan("fleet-engine-dp0", 0, "mp", [0], [], None, clients, addresses)


def config_with(routing: str = "cache-aware", prefix_caching: bool = True, external_lb: bool = False) -> FleetConfig:
    parallel = ParallelConfig(data_parallel_size=2, data_parallel_routing=routing, data_parallel_external_lb=external_lb)
    return FleetConfig(parallel=parallel, cache=CacheConfig(enable_prefix_caching=prefix_caching))


def test_engines_relay_prompt_blocks_to_several_api_servers_that_route_by_prefix():
    assert relays_prompt_blocks(config_with(), engine_plan(num_clients=2))


@pytest.mark.parametrize("config,plan,why", [
    (config_with(), engine_plan(1), "one API server knows what it sent"),
    (config_with(), engine_plan(2, coordinator=False), "no coordinator (one replica): nobody would take them"),
    (config_with("least-loaded"), engine_plan(2), "no prefix routing"),
    (config_with("round-robin"), engine_plan(2), "no prefix routing"),
    (config_with(prefix_caching=False), engine_plan(2), "no prefix cache"),
    (config_with(external_lb=True), engine_plan(2), "one replica per front end: nothing to route"),
])
def test_engines_relay_nothing_otherwise(config, plan, why):
    assert not relays_prompt_blocks(config, plan), why
