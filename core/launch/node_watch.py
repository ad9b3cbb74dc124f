"""How the launchers of a multi-node job watch each other through the job
store (core/launch/job_store.py): each node announces itself and node 0 waits
for all of them; each beats a heartbeat from a thread of its own and node 0
watches every beat; a node going down says so first, so that a dead node
takes the job down everywhere; or, where replicas restart
(ParallelConfig.restarts_replicas), node 0 serves on with the replicas of the
other nodes and a lost node's launch, started again, rejoins."""
from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from fleet.core.launch.job_store import JobStore
from fleet.core.launch.processes import NodeMissing

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
NODE_SILENCE_LIMIT_S = 3.0
"""A node whose heartbeat stood still this long is taken for dead: a machine
that vanishes is noticed within 3.5 s. A node that fails on its own says so
(report_failure) and is noticed within one beat."""


def join(job: JobStore) -> None:
    """Announce this node; node 0 waits for every other one (under
    --distributed-timeout-seconds) and names those that never came."""
    parallel, store = job.parallel, job.store
    store.set(f"node/{job.node_rank}", "joined")
    if job.node_rank != 0:
        return
    deadline = time.monotonic() + parallel.distributed_timeout_seconds
    others = range(1, parallel.nnodes)
    while missing := [rank for rank in others if not store.check([f"node/{rank}"])]:
        if time.monotonic() > deadline:
            raise NodeMissing(
                f"node ranks {missing} did not join within {parallel.distributed_timeout_seconds} s "
                f"(--distributed-timeout-seconds) at {parallel.master_addr}:{parallel.master_port}"
            )
        time.sleep(0.2)
    logger.info("all %d nodes joined", parallel.nnodes)


def report_failure(job: JobStore, reason: str) -> None:
    """Tell node 0 that this node is going down, so that it need not wait for the silence."""
    try:
        job.store.set(f"failed/{job.node_rank}", reason[:500])
    except (RuntimeError, dist.DistStoreError):
        pass  # node 0 is gone already


class Heartbeat:
    """Beats for this node from a thread of its own, from the moment the node
    joined, so that a launcher busy starting or supervising never falls
    silent; on node 0 it also watches the others. A loss that ends the job is
    kept in `lost` for the launcher to act on; where replicas restart, node 0
    only logs the loss of another node (its API servers see that node's
    engines fall silent) and its return."""

    def __init__(self, job: JobStore):
        self.job = job  # its own connection: the launcher's is used from the launcher's thread
        self.lost: NodeMissing | None = None
        self.survives_other_nodes = job.parallel.restarts_replicas
        self.gone: set[int] = set()
        """Other nodes lost while node 0 serves on, until they join again."""
        self._beats_seen: dict[int, tuple[int, float]] = {}
        threading.Thread(target=self._run, name="fleet-heartbeat", daemon=True).start()

    def _run(self) -> None:
        """Until a loss; the thread dies with the launcher."""
        while True:
            time.sleep(HEARTBEAT_INTERVAL_S)
            try:
                self._beat()
            except NodeMissing as error:
                self.lost = error
                return

    def _beat(self) -> None:
        """Show this node alive; node 0 also checks everyone else's beat.
        Raises NodeMissing for a silent node, or when node 0 (the store) is gone."""
        parallel, store = self.job.parallel, self.job.store
        try:
            store.add(f"beat/{self.job.node_rank}", 1)
            if self.job.node_rank == 0:
                self._check_beats()
        except (RuntimeError, dist.DistStoreError) as error:
            where = f"{parallel.master_addr}:{parallel.master_port}"
            raise NodeMissing(f"lost node 0's job store at {where}: {error}") from error

    def _check_beats(self) -> None:
        for rank in range(1, self.job.parallel.nnodes):
            if rank in self.gone:
                self._check_rejoined(rank)
                continue
            loss = self._loss_of(rank)
            if loss is None:
                continue
            if not self.survives_other_nodes:
                raise loss
            self._forget(rank)
            logger.error("%s: its replicas are down, the other nodes' serve on; `fleet launch` with "
                         "--node-rank %d started again there rejoins the job", loss, rank)

    def _loss_of(self, rank: int) -> NodeMissing | None:
        store, now = self.job.store, time.monotonic()
        if store.check([f"failed/{rank}"]):
            return NodeMissing(f"node {rank} failed: {store.get(f'failed/{rank}').decode()}")
        count = store.add(f"beat/{rank}", 0)
        last_count, since = self._beats_seen.get(rank, (-1, now))
        if count != last_count:
            self._beats_seen[rank] = (count, now)
        elif now - since > NODE_SILENCE_LIMIT_S:
            return NodeMissing(f"node {rank} stopped answering (no heartbeat for {NODE_SILENCE_LIMIT_S:.0f} s)")
        return None

    def _forget(self, rank: int) -> None:
        """A lost node: its keys go, so that its next launch is seen to join."""
        self.gone.add(rank)
        self._beats_seen.pop(rank, None)
        for key in (f"node/{rank}", f"failed/{rank}"):
            self.job.store.delete_key(key)

    def _check_rejoined(self, rank: int) -> None:
        store = self.job.store
        if store.check([f"failed/{rank}"]):
            store.delete_key(f"failed/{rank}")  # said late, by the launch that was lost
        if store.check([f"node/{rank}"]):
            self.gone.discard(rank)
            logger.info("node %d joined again", rank)
