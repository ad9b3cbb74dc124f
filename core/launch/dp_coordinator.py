"""The data-parallel coordinator: one process per job, beside data-parallel
rank 0, when the job has several replicas.

- Load: engines send EngineLoad whenever their queues change; the
  coordinator publishes the table to the API servers of its node (at most
  every LOAD_PUBLISH_INTERVAL_S), so that each API server can correct its
  own in-flight counts with the requests the others sent. With cache-aware
  routing by several API servers the engines add the block hashes of the
  prompts they took, which the coordinator passes on the same way, so that
  each API server knows where the others sent which prefix
  (frontend/load_balancer.py; `relays_prompt_blocks`).
- Waves, for replicas that step together (MoE with expert parallel across
  replicas, whose collectives need every replica in every step): before
  each step every engine votes (StepVote: has it work?); once all voted the
  coordinator broadcasts StepDecision(run = any had work). With run, every
  engine steps, an idle one with no tokens; without, all go idle and block.
  The first vote while all are idle makes the coordinator wake the others
  (WaveWakeUp) so that they vote too. Steps are numbered, so a stale wake-up
  is recognised and dropped.
- It hosts the TCPStore where the workers of lock-step replicas meet, so
  that the store outlives any one engine and sits at a known address.
"""
from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from fleet.config.fleet import FleetConfig
from fleet.core import ipc, serial
from fleet.core.launch import processes
from fleet.core.launch.node_plan import CoordinatorPlan, EngineCorePlan, StoreLocation
from fleet.core.messages import (
    CoordinatorInput,
    EngineLoad,
    EngineLoads,
    Ready,
    StepDecision,
    StepVote,
    WaveWakeUp,
)

logger = logging.getLogger(__name__)

LOAD_PUBLISH_INTERVAL_S = 0.02
"""Load changes reach the API servers within this (batched, not one message per change)."""


def relays_prompt_blocks(config: FleetConfig, plan: EngineCorePlan) -> bool:
    """Whether the engine of `plan` reports the blocks of the prompts it takes to the coordinator
    (EngineLoad.new_prompt_blocks): its API servers route by prefix, and each sees only its own requests."""
    parallel = config.parallel
    return (parallel.data_parallel_routing == "cache-aware" and bool(config.cache.enable_prefix_caching)
            and not parallel.data_parallel_external_lb and plan.coordinator is not None and len(plan.clients) > 1)


class CoordinatorStartupInfo(msgspec.Struct):
    config: FleetConfig
    handshake_address: str
    plan: CoordinatorPlan


class WaveState:
    """The lock-step votes of one job, as pure logic: votes in, broadcasts out."""

    def __init__(self, num_engines: int):
        self.num_engines = num_engines
        self.step = 0
        self.votes: dict[int, bool] = {}
        self.running = False

    def vote(self, vote: StepVote) -> list[WaveWakeUp | StepDecision]:
        if vote.step != self.step:
            raise ValueError(f"engine dp{vote.dp_rank} voted for step {vote.step} during step {self.step}")
        broadcasts: list[WaveWakeUp | StepDecision] = []
        if not self.votes and not self.running:
            broadcasts.append(WaveWakeUp(self.step))
        self.votes[vote.dp_rank] = vote.has_work
        if len(self.votes) == self.num_engines:
            self.running = any(self.votes.values())
            broadcasts.append(StepDecision(self.step, self.running))
            self.step += 1
            self.votes = {}
        return broadcasts


class LoadTable:
    """Each engine's queue, and the prompt blocks it took since the last
    publication (relays_prompt_blocks), as pure logic: loads in, tables out."""

    def __init__(self, num_engines: int):
        self.num_waiting = [0] * num_engines
        self.num_running = [0] * num_engines
        self.new_prompt_blocks: list[list[bytes]] = [[] for _ in range(num_engines)]

    def update(self, load: EngineLoad) -> None:
        self.num_waiting[load.dp_rank], self.num_running[load.dp_rank] = load.num_waiting, load.num_running
        self.new_prompt_blocks[load.dp_rank] += load.new_prompt_blocks

    def publication(self) -> EngineLoads:
        """The table to publish now; prompt blocks go out once."""
        if not any(self.new_prompt_blocks):
            return EngineLoads(list(self.num_waiting), list(self.num_running))
        blocks, self.new_prompt_blocks = self.new_prompt_blocks, [[] for _ in self.new_prompt_blocks]
        return EngineLoads(list(self.num_waiting), list(self.num_running), blocks)


class Coordinator:
    def __init__(self, config: FleetConfig, plan: CoordinatorPlan):
        self.config = config
        addresses = plan.addresses
        self.num_engines = config.parallel.data_parallel_size
        self.ctx = zmq.Context()
        self.inputs = ipc.make_socket(self.ctx, zmq.PULL, bind=addresses.engine_inputs)
        self.broadcast = ipc.make_socket(self.ctx, zmq.XPUB, bind=addresses.engine_broadcast)
        self.broadcast.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.loads = ipc.make_socket(self.ctx, zmq.PUB, bind=addresses.loads)
        self.waves = WaveState(self.num_engines)
        self.load_table = LoadTable(self.num_engines)
        self.store = self._host_store(plan.store) if plan.store is not None else None

    def _host_store(self, store: StoreLocation):
        """The job-wide TCPStore of lock-step workers (port 0: the bound port is reported)."""
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore(
            store.host, store.port, is_master=True, wait_for_workers=False,
            timeout=timedelta(seconds=self.config.parallel.distributed_timeout_seconds),
        )

    @property
    def store_port(self) -> int:
        return self.store.port if self.store is not None else 0

    def run(self) -> None:
        if self.config.parallel.replicas_step_together:
            self._await_engine_subscriptions()
        decoder = serial.Decoder(CoordinatorInput, "coordinator input")
        dirty_since: float | None = None
        while True:
            wait_ms = None if dirty_since is None else _ms_until(dirty_since + LOAD_PUBLISH_INTERVAL_S)
            if self.inputs.poll(wait_ms):
                message = decoder.decode(self.inputs.recv())
                match message:
                    case StepVote():
                        for broadcast in self.waves.vote(message):
                            self.broadcast.send(serial.encode(broadcast))
                    case EngineLoad():
                        self.load_table.update(message)
                        dirty_since = dirty_since or time.monotonic()
            if dirty_since is not None and time.monotonic() - dirty_since >= LOAD_PUBLISH_INTERVAL_S:
                self.loads.send(serial.encode(self.load_table.publication()))
                dirty_since = None

    def _await_engine_subscriptions(self) -> None:
        """A PUB drops what it sends before a subscriber joined: no vote is
        read (so nothing is broadcast) until every engine subscribed."""
        subscribed = 0
        while subscribed < self.num_engines:
            if self.broadcast.recv()[:1] == b"\x01":
                subscribed += 1
        logger.info("all %d engines joined", self.num_engines)


def _ms_until(deadline: float) -> int:
    return int(max(0.0, deadline - time.monotonic()) * 1000) + 1


def main() -> None:
    processes.child_main(CoordinatorStartupInfo, run_coordinator)


def run_coordinator(name: str, info: CoordinatorStartupInfo) -> None:
    coordinator = processes.start_or_report(name, info.handshake_address,
                                            lambda: Coordinator(info.config, info.plan))
    ready = Ready(name, os.getpid(), addresses={"store_port": str(coordinator.store_port)})
    processes.report(info.handshake_address, ready)
    coordinator.run()


if __name__ == "__main__":
    main()
