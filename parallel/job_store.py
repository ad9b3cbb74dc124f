"""The job store of a multi-node launch: a torch TCPStore that node 0's
launcher hosts at --master-addr:--master-port.

Launches meet there (each node announces itself; node 0 waits for all and
names the missing ones), publish what others must find (the addresses of an
executor whose replica spans nodes) and beat a heartbeat so that a dead node
takes the job down everywhere. Workers' torch.distributed worlds live in it
too, each under its own prefix.
"""
from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import msgspec
import torch.distributed as dist

from fleet.config.parallel import ParallelConfig
from fleet.core.processes import NodeMissing

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
NODE_SILENCE_LIMIT_S = 3.0
"""A node whose heartbeat stood still this long is taken for dead: a machine
that vanishes is noticed within 3.5 s. A node that fails on its own says so
(report_failure) and is noticed within one beat."""


def connect_store(parallel: ParallelConfig, is_master: bool = False) -> dist.TCPStore:
    """A client (or, on node 0's launcher, the server) of the job store."""
    timeout = timedelta(seconds=parallel.distributed_timeout_seconds)
    try:
        return dist.TCPStore(
            parallel.master_addr, parallel.master_port, is_master=is_master, wait_for_workers=False, timeout=timeout
        )
    except (RuntimeError, dist.DistStoreError) as error:
        raise NodeMissing(
            f"could not reach node 0's job store at {parallel.master_addr}:{parallel.master_port} "
            f"(--master-addr, --master-port) within {parallel.distributed_timeout_seconds} s: {error}"
        ) from error


class JobStore:
    def __init__(self, parallel: ParallelConfig, is_master: bool = False):
        self.parallel = parallel
        self.node_rank = parallel.node_rank
        self.store = connect_store(parallel, is_master)
        self._beats_seen: dict[int, tuple[int, float]] = {}

    @classmethod
    def for_launcher(cls, parallel: ParallelConfig) -> JobStore:
        """Node 0's launcher hosts the store; the others connect to it."""
        return cls(parallel, is_master=parallel.node_rank == 0)

    @classmethod
    def client(cls, parallel: ParallelConfig) -> JobStore:
        return cls(parallel)

    def join(self) -> None:
        """Announce this node; node 0 waits for every other one (under
        --distributed-timeout-seconds) and names those that never came."""
        self.store.set(f"node/{self.node_rank}", "joined")
        if self.node_rank != 0:
            return
        deadline = time.monotonic() + self.parallel.distributed_timeout_seconds
        others = range(1, self.parallel.nnodes)
        while missing := [rank for rank in others if not self.store.check([f"node/{rank}"])]:
            if time.monotonic() > deadline:
                raise NodeMissing(
                    f"node ranks {missing} did not join within {self.parallel.distributed_timeout_seconds} s "
                    f"(--distributed-timeout-seconds) at {self.parallel.master_addr}:{self.parallel.master_port}"
                )
            time.sleep(0.2)
        logger.info("all %d nodes joined", self.parallel.nnodes)

    def publish(self, key: str, value: msgspec.Struct) -> None:
        self.store.set(key, msgspec.msgpack.encode(value))

    def lookup(self, key: str, value_type: type) -> msgspec.Struct:
        """Wait for `key` (under --distributed-timeout-seconds) and decode it."""
        try:
            self.store.wait([key], timedelta(seconds=self.parallel.distributed_timeout_seconds))
        except (RuntimeError, dist.DistStoreError) as error:
            raise NodeMissing(f"nobody published {key!r} in the job store: {error}") from error
        return msgspec.msgpack.decode(self.store.get(key), type=value_type)

    def beat(self) -> None:
        """Show this node alive; node 0 also checks everyone else's beat.
        Raises NodeMissing for a silent node, or when node 0 (the store) is gone."""
        try:
            self.store.add(f"beat/{self.node_rank}", 1)
            if self.node_rank == 0:
                self._check_beats()
        except (RuntimeError, dist.DistStoreError) as error:
            where = f"{self.parallel.master_addr}:{self.parallel.master_port}"
            raise NodeMissing(f"lost node 0's job store at {where}: {error}") from error

    def report_failure(self, reason: str) -> None:
        """Tell node 0 that this node is going down, so that it need not wait for the silence."""
        try:
            self.store.set(f"failed/{self.node_rank}", reason[:500])
        except (RuntimeError, dist.DistStoreError):
            pass  # node 0 is gone already

    def _check_beats(self) -> None:
        now = time.monotonic()
        for rank in range(1, self.parallel.nnodes):
            if self.store.check([f"failed/{rank}"]):
                raise NodeMissing(f"node {rank} failed: {self.store.get(f'failed/{rank}').decode()}")
            count = self.store.add(f"beat/{rank}", 0)
            last_count, since = self._beats_seen.get(rank, (-1, now))
            if count != last_count:
                self._beats_seen[rank] = (count, now)
            elif now - since > NODE_SILENCE_LIMIT_S:
                raise NodeMissing(f"node {rank} stopped answering (no heartbeat for {NODE_SILENCE_LIMIT_S:.0f} s)")


class Heartbeat:
    """Beats for this node from a thread of its own, from the moment the node
    joined, so that a launcher busy starting or supervising never falls
    silent; on node 0 it also watches the others. The first loss is kept in
    `lost` for the launcher to act on."""

    def __init__(self, parallel: ParallelConfig):
        self.job = JobStore.client(parallel)  # its own connection: the launcher's is used from its own thread
        self.lost: NodeMissing | None = None
        threading.Thread(target=self._run, name="fleet-heartbeat", daemon=True).start()

    def _run(self) -> None:
        """Until a loss; the thread dies with the launcher."""
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            try:
                self.job.beat()
            except NodeMissing as error:
                self.lost = error
                return
