"""Restarting a dead data-parallel replica while the others serve: the
launcher's side of issue 28.

A replica is the unit of failure: its engine core and the workers under it
(they die with it, and it dies when one of them does). The launcher hands a
dead engine core to `ReplicaRestarts`, which decides by
--replica-restart-policy and the restart budget (--max-replica-restarts in
any RESTART_WINDOW_S) whether it comes back, waits out an exponential
back-off, starts it again from the same plan entry (same name, addresses
and ranks) and collects its Ready without blocking the launcher's watch
over everything else. The front ends notice the replica go and come back
on their own (frontend/engine_client.py)."""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import zmq

from fleet.config.fleet import FleetConfig
from fleet.core.launch import processes
from fleet.core.launch.engine_launch import start_engine_cores
from fleet.core.launch.node_plan import EngineCorePlan, StartupFacts
from fleet.core.messages import StartupFailed

logger = logging.getLogger("fleet.launch")

RESTART_WINDOW_S = 600.0
"""--max-replica-restarts counts the restarts of this many seconds."""
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
"""A replica that served this long before it died starts again from the first back-off."""


class RestartRefused(Exception):
    """The policy or the budget says the job ends; the message says which."""


@dataclass
class _Replica:
    plan: EngineCorePlan
    failures_in_a_row: int = 0
    due: float = 0.0
    """When the next start may begin (back-off)."""
    died_at: float = 0.0
    ready_at: float | None = None
    starting: processes.ChildProcess | None = None
    """Started again and not Ready yet."""


class ReplicaRestarts:
    def __init__(self, config: FleetConfig, plans: list[EngineCorePlan], facts: StartupFacts):
        self.config = config
        self.facts = facts
        self.replicas = {plan.name: _Replica(plan, ready_at=time.monotonic()) for plan in plans}
        self.restart_times: deque[float] = deque()
        self._ctx: zmq.Context | None = None
        self._handshake: processes.HandshakeListener | None = None

    def handles(self, child: processes.ChildProcess) -> bool:
        """Whether `child` is an engine core whose death this launch survives."""
        return self.config.parallel.restarts_replicas and child.name in self.replicas

    def replica_died(self, child: processes.ChildProcess) -> None:
        """Schedule the restart of `child`'s replica, or raise RestartRefused."""
        replica = self.replicas[child.name]
        replica.starting = None
        child.release()
        now = time.monotonic()
        served = replica.ready_at is not None and now - replica.ready_at >= STABLE_AFTER_S
        replica.failures_in_a_row = 1 if served else replica.failures_in_a_row + 1
        self._spend_budget(child, now)
        backoff = min(FIRST_BACKOFF_S * 2 ** (replica.failures_in_a_row - 1), MAX_BACKOFF_S)
        replica.died_at, replica.due, replica.ready_at = now, now + backoff, None
        logger.error("%s; restarting replica dp%d in %.0f s (restart %d of %d allowed in %.0f min)", child.describe_exit(),
                     replica.plan.dp_rank, backoff, len(self.restart_times), self._budget, RESTART_WINDOW_S / 60)

    @property
    def _budget(self) -> int:
        return self.config.parallel.max_replica_restarts

    def _spend_budget(self, child: processes.ChildProcess, now: float) -> None:
        while self.restart_times and now - self.restart_times[0] > RESTART_WINDOW_S:
            self.restart_times.popleft()
        if len(self.restart_times) >= self._budget:
            raise RestartRefused(
                f"{child.describe_exit()}; {len(self.restart_times)} replica restarts in the last "
                f"{RESTART_WINDOW_S / 60:.0f} minutes spent the budget (--max-replica-restarts {self._budget})"
            )
        self.restart_times.append(now)

    def poll(self) -> list[processes.ChildProcess]:
        """Start the replicas whose back-off ended and return their engine
        cores (the launcher watches them from now on: one that dies before
        it is Ready comes back here), and log those that became Ready."""
        now = time.monotonic()
        started = []
        for replica in self.replicas.values():
            if replica.ready_at is None and replica.starting is None and now >= replica.due:
                replica.starting = self._start(replica.plan)
                started.append(replica.starting)
        self._collect_ready()
        return started

    def _start(self, plan: EngineCorePlan) -> processes.ChildProcess:
        if self._handshake is None:
            parallel = self.config.parallel
            # Engine actors placed by Ray may run on another machine: they report over TCP.
            tcp_host = parallel.data_parallel_address if parallel.data_parallel_backend == "ray" else None
            self._ctx = zmq.Context()
            self._handshake = processes.HandshakeListener(self._ctx, tcp_host)
        logger.info("starting %s again", plan.name)
        return start_engine_cores(self.config, [plan], self._handshake.address, self.facts)[0]

    def _collect_ready(self) -> None:
        while self._handshake is not None:
            message = self._handshake.receive(timeout_ms=0)
            if message is None:
                return
            replica = self.replicas.get(message.name)
            if replica is None or replica.starting is None:
                continue
            if isinstance(message, StartupFailed):
                logger.error("%s failed to start again: %s", message.name, message.error)
                continue  # it exits: the launcher sees that and hands it back to replica_died
            replica.starting, replica.ready_at = None, time.monotonic()
            logger.info("%s (pid %d) restarted: replica dp%d serves again %.1f s after it died", message.name,
                        message.pid, replica.plan.dp_rank, replica.ready_at - replica.died_at)

    def close(self) -> None:
        if self._handshake is not None:
            self._handshake.close()
            self._ctx.destroy(linger=0)
            self._handshake = None
