"""Least-loaded engine choice: own counts corrected by published loads."""
from __future__ import annotations

from fleet.core.messages import EngineLoads
from fleet.frontend.load_balancer import LoadBalancer


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
