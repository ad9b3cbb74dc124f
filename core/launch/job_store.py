"""The job store of a multi-node launch: a torch TCPStore that node 0's
launcher hosts at --master-addr:--master-port.

Processes publish there what others must find (the addresses of an executor
whose replica spans nodes); the launchers meet and watch each other there
(core/launch/node_watch.py). Workers' torch.distributed worlds live in it too,
each under its own prefix.
"""
from __future__ import annotations

from datetime import timedelta

import msgspec
import torch.distributed as dist

from fleet.config.parallel import ParallelConfig
from fleet.core.launch.processes import NodeMissing


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

    @classmethod
    def for_launcher(cls, parallel: ParallelConfig) -> JobStore:
        """Node 0's launcher hosts the store; the others connect to it."""
        return cls(parallel, is_master=parallel.node_rank == 0)

    @classmethod
    def client(cls, parallel: ParallelConfig) -> JobStore:
        return cls(parallel)

    def publish(self, key: str, value: msgspec.Struct) -> None:
        self.store.set(key, msgspec.msgpack.encode(value))

    def lookup(self, key: str, value_type: type) -> msgspec.Struct:
        """Wait for `key` (under --distributed-timeout-seconds) and decode it."""
        try:
            self.store.wait([key], timedelta(seconds=self.parallel.distributed_timeout_seconds))
        except (RuntimeError, dist.DistStoreError) as error:
            raise NodeMissing(f"nobody published {key!r} in the job store: {error}") from error
        return msgspec.msgpack.decode(self.store.get(key), type=value_type)
