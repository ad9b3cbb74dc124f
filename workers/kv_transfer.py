"""Prefill/decode disaggregation, the workers' side: KV blocks from worker
to worker (core/kv_transfer.py has the scheduling).

A prefill instance's worker serves its share of exported requests' KV on a
ZMQ ROUTER (KVExportServer, on its own thread); the decode instance's worker
of the same rank pulls it with a DEALER (KVPuller) and copies it into its
blocks. One pull answers with one frame per layer, the layer's K and V of the
requested blocks, contiguous: no pickle, no per-token message. The export
table and the cache reads share one lock with the step that applies the
engine's releases, so a released block is never served after the step that
may reuse it began.
"""
from __future__ import annotations

import itertools
import logging
import threading

import torch
import zmq

from fleet.config.kv_transfer import KVTransferConfig
from fleet.core import ipc, serial
from fleet.core.messages import KVLoad, KVPull, KVPullReply, SchedulerOutput
from fleet.parallel.comm import get_tp_group

logger = logging.getLogger(__name__)


class KVExportServer:
    """Serves this worker's share of the KV of exported requests."""

    def __init__(self, host: str, port: int = 0):
        self.kv_caches: list[torch.Tensor] = []
        """Set once the KV cache is allocated (the address is reported before)."""
        self._exports: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._socket = ipc.make_socket(self._ctx, zmq.ROUTER)
        self.address = ipc.bind_tcp(self._socket, host, port)
        threading.Thread(target=self._serve, name="kv-export", daemon=True).start()

    def apply(self, exports: dict[str, list[int]], releases: list[str]) -> None:
        """The step's changes, before its forward may write into released blocks."""
        if not exports and not releases:
            return
        with self._lock:
            self._exports.update(exports)
            for request_id in releases:
                self._exports.pop(request_id, None)

    def _serve(self) -> None:
        decoder = serial.Decoder(KVPull, "kv pulls")
        while True:
            identity, frame = self._socket.recv_multipart()
            pull = decoder.decode(frame)
            if pull is None:
                continue
            header, layers = self._read(pull)
            self._socket.send_multipart([identity, serial.encode(header), *layers], copy=False)

    def _read(self, pull: KVPull) -> tuple[KVPullReply, list[memoryview]]:
        with self._lock:
            block_ids = self._exports.get(pull.request_id)
            if block_ids is None or not self.kv_caches:
                return KVPullReply(pull.transfer_id, error=f"no KV of {pull.request_id} here (released?)"), []
            if not 0 <= pull.first_block < len(block_ids):
                return KVPullReply(pull.transfer_id, error=f"first block {pull.first_block} out of range"), []
            index = torch.tensor(block_ids[pull.first_block:], dtype=torch.long, device=self.kv_caches[0].device)
            layers = [cache.index_select(1, index).cpu() for cache in self.kv_caches]
        shape = list(layers[0].shape)
        dtype = str(layers[0].dtype).removeprefix("torch.")
        return KVPullReply(pull.transfer_id, shape=shape, dtype=dtype), [_as_bytes(layer) for layer in layers]

    def close(self) -> None:
        self._ctx.destroy(linger=0)


class KVPuller:
    """Pulls a request's KV from prefill workers into this worker's blocks."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank = rank
        """This worker's rank in its replica: it pulls from the remote worker of the same rank."""
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sockets: dict[str, zmq.Socket] = {}
        self._transfer_ids = itertools.count()
        self._decoder = serial.Decoder(KVPullReply, "kv pull replies")

    def load(self, load: KVLoad, kv_caches: list[torch.Tensor]) -> str | None:
        """Fill load.block_ids of every layer; None, or why it failed (the blocks then hold nothing valid)."""
        address = load.remote_kv_addresses[self.rank]
        transfer_id = next(self._transfer_ids)
        try:
            frames = self._request(address, KVPull(transfer_id, load.remote_request_id, load.remote_first_block))
        except TimeoutError:
            self._drop(address)  # a late reply must not be read as another transfer's
            return f"no KV from {address} within {self.timeout_s:g} s"
        except zmq.ZMQError as error:  # the params came from a client: an address may be nonsense
            self._drop(address)
            return f"cannot reach {address!r}: {error}"
        header = self._decoder.decode(frames[0])
        if header is None or header.transfer_id != transfer_id:
            return f"a malformed reply from {address}"
        if header.error is not None:
            return f"{address}: {header.error}"
        try:
            return _copy_in(header, frames[1:], load.block_ids, kv_caches)
        except (RuntimeError, ValueError, TypeError) as error:  # frames that do not hold what the header says
            return f"a malformed reply from {address}: {error}"

    def _request(self, address: str, pull: KVPull) -> list[zmq.Frame]:
        socket = self._sockets.get(address)
        if socket is None:
            socket = self._sockets[address] = ipc.make_socket(self._ctx, zmq.DEALER, connect=address)
        socket.send(serial.encode(pull))
        if not socket.poll(int(self.timeout_s * 1000)):
            raise TimeoutError(address)
        return socket.recv_multipart(copy=False)

    def _drop(self, address: str) -> None:
        socket = self._sockets.pop(address, None)
        if socket is not None:
            socket.close(linger=0)

    def close(self) -> None:
        self._ctx.destroy(linger=0)


def _copy_in(header: KVPullReply, frames: list[zmq.Frame], block_ids: list[int],
             kv_caches: list[torch.Tensor]) -> str | None:
    """Copy each layer's frame into the local blocks, if it is what they expect."""
    local = kv_caches[0]
    expected = [2, len(block_ids), *local.shape[2:]]
    dtype = str(local.dtype).removeprefix("torch.")
    same_blocks = header.shape[:1] + header.shape[2:] == expected[:1] + expected[2:]
    if len(frames) != len(kv_caches) or header.dtype != dtype or not same_blocks:
        return (f"the remote KV is {len(frames)} layers of {header.shape} {header.dtype}; "
                f"this worker holds {len(kv_caches)} layers of blocks {expected} {dtype}")
    if header.shape[1] < len(block_ids):
        return f"the remote sent {header.shape[1]} blocks, {len(block_ids)} are needed"
    index = torch.tensor(block_ids, dtype=torch.long, device=local.device)
    for frame, cache in zip(frames, kv_caches, strict=True):
        remote = torch.frombuffer(frame.buffer, dtype=local.dtype).view(header.shape)
        cache.index_copy_(1, index, remote[:, : len(block_ids)].to(cache.device))
    return None


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, without a copy (any dtype, bfloat16 included)."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


class WorkerKVTransfer:
    """One worker's part in KV transfer: a server (producer), a puller (consumer), or both."""

    def __init__(self, config: KVTransferConfig, rank: int, first_port: int):
        """`rank`: in the replica; `first_port`: this worker's fixed port (0: a free one)."""
        self.server = KVExportServer(config.kv_ip, first_port) if config.is_producer else None
        self.puller = KVPuller(rank, config.transfer_timeout_s) if config.is_consumer else None

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    def step(self, scheduler_output: SchedulerOutput, kv_caches: list[torch.Tensor]) -> dict[str, str]:
        """Apply the step's exports and releases and run its loads; the loads that failed on any
        worker of the tensor-parallel group, with why (every worker runs this with the same plan)."""
        if self.server is not None:
            self.server.kv_caches = kv_caches
            self.server.apply(scheduler_output.kv_exports, scheduler_output.kv_export_releases)
        loads = scheduler_output.kv_loads
        if not loads:
            return {}
        failures: dict[str, str] = {}
        for load in loads:
            why = self.puller.load(load, kv_caches) if self.puller is not None else "this instance is no consumer"
            if why is not None:
                logger.warning("KV of %s not loaded: %s", load.request_id, why)
                failures[load.request_id] = why
        flags = [load.request_id in failures for load in loads]
        failed_anywhere = get_tp_group().all_reduce(torch.tensor(flags, dtype=torch.int32, device=kv_caches[0].device))
        return {load.request_id: failures.get(load.request_id, "the load failed on another worker")
                for load, failed in zip(loads, failed_anywhere.tolist(), strict=True) if failed}

    def close(self) -> None:
        for part in (self.server, self.puller):
            if part is not None:
                part.close()
