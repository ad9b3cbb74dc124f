"""Reading `fleet plan`'s JSON in tests: the node plan's processes in one
list, in the order the launcher and the executors start them."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from fleet.core.launch.process_names import sandbox_name


def planned_processes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process of the node plan, each with its `kind`: API servers, the
    coordinator, engine cores, workers (each engine's, then those of engines
    on other nodes), then each API server's sandbox processes."""

    node = plan["node"]
    processes = [{"kind": "api_server", **server} for server in node["api_servers"]]
    if node["dp_coordinator"] is not None:
        processes.append({"kind": "dp_coordinator", **node["dp_coordinator"]})
    processes.extend({"kind": "engine_core", **engine} for engine in node["engine_cores"])
    workers = [worker for engine in node["engine_cores"] for worker in engine["workers"]]
    workers.extend(node["workers_of_remote_engines"])
    processes.extend({"kind": "worker", **worker} for worker in workers)
    processes.extend({"kind": "sandbox", "name": sandbox_name(server["index"], number)}
                     for server in node["api_servers"] for number in range(1, server["sandbox_processes"] + 1))
    return processes


def kinds(plan: dict[str, Any]) -> Counter[str]:
    return Counter(process["kind"] for process in planned_processes(plan))


def of_kind(plan: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [process for process in planned_processes(plan) if process["kind"] == kind]


LAUNCHER = "fleet-launch"
"""The key of the launcher itself (it hosts node 0's job store)."""


def planned_tcp_ports(plan: dict[str, Any]) -> dict[str, set[int]]:
    """The TCP ports the plan fixes, by the name of the process that listens
    on them; ports left to start-up (0) are not known in advance."""
    node = plan["node"]
    ports: dict[str, set[int]] = defaultdict(set)
    for server in node["api_servers"]:
        ports[server["name"]].update(_tcp_ports([server["url"], *server["addresses"].values()]))
    coordinator = node["dp_coordinator"]
    if coordinator is not None:
        ports[coordinator["name"]].update(_tcp_ports(coordinator["addresses"].values()))
        if coordinator["store"] is not None and coordinator["store"]["port"]:
            ports[coordinator["name"]].add(coordinator["store"]["port"])
    for engine in node["engine_cores"]:
        store = engine["store"]
        if store is not None and store["hosted_by"] == "executor" and store["port"]:
            ports[engine["name"]].add(store["port"])
    if node["job_store"] is not None and node["node_rank"] == 0:
        ports[LAUNCHER].add(node["job_store"]["port"])
    return dict(ports)


def _tcp_ports(addresses: Iterable[str]) -> set[int]:
    ports = {int(address.rsplit(":", 1)[1]) for address in addresses if address.startswith(("tcp://", "http://"))}
    return ports - {0}
