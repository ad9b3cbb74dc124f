"""Prefill/decode disaggregation, the workers' side: KV blocks from worker
to worker (core/kv_connector.py has the scheduling).

A prefill instance's worker serves its share of exported requests' KV on a
ZMQ ROUTER (KVExportServer, on its own thread); the decode instance's worker
of the same rank pulls it (KVPuller, on threads of its own, beside the steps)
and copies it into the request's blocks. One pull answers with one frame per
layer, the layer's K and V of the requested blocks, contiguous: no pickle, no
per-token message. The export table and the cache reads share one lock with
the step that applies the engine's releases, so a released block is never
served after the step that may reuse it began.

What a pull must match before the producer serves it: the transfer id (128
random bits), the prompt (its sha256), and the consumer that pulled it first.
What a reply must match before the consumer copies it: the pull, the dtype,
the shape and byte size of every layer's blocks. Anything else is refused,
counted and logged; no message kills a thread.
"""
from __future__ import annotations

import hmac
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import zmq

from fleet.config.kv_transfer import KVTransferConfig
from fleet.core import ipc, serial
from fleet.core.messages import KVExport, KVLoad, KVPull, KVPullReply, SchedulerOutput
from fleet.parallel.comm import get_tp_group

logger = logging.getLogger(__name__)

MAX_PULL_BYTES = 4096
"""Largest message the export server takes (a KVPull is about 150 bytes)."""
PULL_THREADS = 4
"""Pulls a worker runs at once; more wait their turn (their deadline runs meanwhile)."""
LOAD_POLL_S = 0.02
"""How long a step with nothing to compute waits for a pull to end (instead of spinning)."""


@dataclass
class _Served:
    export: KVExport
    consumer_id: str | None = None
    """The first consumer that pulled it: the only one served it afterwards."""


class KVExportServer:
    """Serves this worker's share of the KV of exported requests."""

    def __init__(self, host: str, port: int = 0):
        self.kv_caches: list[torch.Tensor] = []
        """Set once the KV cache is allocated (the address is reported before)."""
        self._exports: dict[str, _Served] = {}
        self._lock = threading.Lock()
        self.num_refused = 0
        """Pulls answered with an error, or dropped as malformed."""
        self._ctx = zmq.Context()
        self._socket = ipc.make_socket(self._ctx, zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_PULL_BYTES)  # reachable from the network
        self.address = ipc.bind_tcp(self._socket, host, port)
        threading.Thread(target=self._serve, name="kv-export", daemon=True).start()

    def apply(self, exports: dict[str, KVExport], releases: list[str]) -> None:
        """The step's changes, before its forward may write into released blocks."""
        if not exports and not releases:
            return
        with self._lock:
            self._exports.update({transfer_id: _Served(export) for transfer_id, export in exports.items()})
            for transfer_id in releases:
                self._exports.pop(transfer_id, None)

    def _serve(self) -> None:
        decoder = serial.Decoder(KVPull, "kv pulls")
        while True:
            try:
                frames = self._socket.recv_multipart()
            except zmq.ZMQError:  # the context was closed
                return
            try:
                self._answer(frames, decoder)
            except Exception:  # noqa: BLE001 - whatever a peer sent, the server keeps serving
                self.num_refused += 1
                logger.exception("a KV pull could not be answered")

    def _answer(self, frames: list[bytes], decoder: serial.Decoder) -> None:
        if len(frames) != 2:  # [identity, pull]: anything else is not ours
            self.num_refused += 1
            return
        identity, frame = frames
        pull = decoder.decode(frame)
        if pull is None:
            self.num_refused += 1
            return
        header, layers = self._read(pull)
        if header.error is not None:
            self.num_refused += 1
            logger.warning("refused a KV pull: %s", header.error)
        self._socket.send_multipart([identity, serial.encode(header), *layers], copy=False)

    def _read(self, pull: KVPull) -> tuple[KVPullReply, list[memoryview]]:
        with self._lock:
            served = self._exports.get(pull.transfer_id)
            why = self._refusal(pull, served)
            if why is not None:
                return KVPullReply(pull.pull_id, error=why), []
            served.consumer_id = pull.consumer_id
            block_ids = served.export.block_ids[pull.first_block:pull.first_block + pull.num_blocks]
            index = torch.tensor(block_ids, dtype=torch.long, device=self.kv_caches[0].device)
            layers = [cache.index_select(1, index).cpu() for cache in self.kv_caches]
        shape = list(layers[0].shape)
        dtype = str(layers[0].dtype).removeprefix("torch.")
        return KVPullReply(pull.pull_id, shape=shape, dtype=dtype), [_as_bytes(layer) for layer in layers]

    def _refusal(self, pull: KVPull, served: _Served | None) -> str | None:
        if served is None or not self.kv_caches:
            return "no such transfer here (released, or never held)"
        if not hmac.compare_digest(pull.prompt_digest, served.export.prompt_digest):
            return "the transfer holds another prompt"
        if served.consumer_id is not None and served.consumer_id != pull.consumer_id:
            return "the transfer was pulled by another consumer"
        num_blocks = len(served.export.block_ids)
        if not (0 <= pull.first_block and 0 < pull.num_blocks and pull.first_block + pull.num_blocks <= num_blocks):
            return f"blocks [{pull.first_block}, +{pull.num_blocks}) are not in the transfer's {num_blocks}"
        return None

    def close(self) -> None:
        self._ctx.destroy(linger=0)


class KVPuller:
    """Pulls requests' KV from prefill workers into this worker's blocks, on threads of its own."""

    def __init__(self, rank: int, timeout_s: float, max_blocks: int):
        self.rank = rank
        """This worker's rank in its replica: it pulls from the remote worker of the same rank."""
        self.timeout_s = timeout_s
        self.max_blocks = max_blocks
        """Most blocks one request holds (max_model_len): no reply frame may be larger than that many."""
        self._ctx = zmq.Context()
        self._pool = ThreadPoolExecutor(PULL_THREADS, thread_name_prefix="kv-pull")
        self._pull_ids = itertools.count()
        self._decoder = serial.Decoder(KVPullReply, "kv pull replies")

    def start(self, load: KVLoad, kv_caches: list[torch.Tensor], done) -> None:
        """Pull in the background; `done(request_id, None or why it failed)` once it ended."""
        deadline = time.monotonic() + self.timeout_s
        self._pool.submit(self._run, load, kv_caches, deadline, done)

    def _run(self, load: KVLoad, kv_caches: list[torch.Tensor], deadline: float, done) -> None:
        try:
            why = self.load(load, kv_caches, deadline)
        except Exception as error:  # noqa: BLE001 - a pull fails alone, never the worker
            logger.exception("KV pull of %s failed", load.request_id)
            why = f"{type(error).__name__}: {error}"
        done(load.request_id, why)

    def load(self, load: KVLoad, kv_caches: list[torch.Tensor], deadline: float) -> str | None:
        """Fill load.block_ids of every layer; None, or why it failed (the blocks then hold nothing valid)."""
        address = load.remote_kv_addresses[self.rank]
        pull = KVPull(next(self._pull_ids), load.transfer_id, load.remote_first_block, len(load.block_ids),
                      load.prompt_digest, load.consumer_id)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return f"no KV from {address} within {self.timeout_s:g} s (queued behind other pulls)"
        # A socket per pull: a late or stray reply can never be read as another pull's.
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_frame_bytes(kv_caches))
        try:
            socket.connect(address)
            socket.send(serial.encode(pull))
            if not socket.poll(int(remaining * 1000)):
                return f"no KV from {address} within {self.timeout_s:g} s"
            frames = socket.recv_multipart(copy=False)
        except zmq.ZMQError as error:
            return f"cannot pull from {address!r}: {error}"
        finally:
            socket.close(linger=0)
        header = self._decoder.decode(frames[0])
        if header is None or header.pull_id != pull.pull_id:
            return f"a malformed reply from {address}"
        if header.error is not None:
            return f"{address}: {header.error}"
        with torch.inference_mode():  # as the steps write the cache
            return _copy_in(header, frames[1:], load.block_ids, kv_caches)

    def _max_frame_bytes(self, kv_caches: list[torch.Tensor]) -> int:
        """A layer's K and V of max_blocks blocks: the largest frame a reply may have."""
        cache = kv_caches[0]
        return cache[:, :1].numel() * cache.element_size() * self.max_blocks

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ctx.destroy(linger=0)


def _copy_in(header: KVPullReply, frames: list[zmq.Frame], block_ids: list[int],
             kv_caches: list[torch.Tensor]) -> str | None:
    """Copy each layer's frame into the local blocks, if it is exactly what they expect."""
    local = kv_caches[0]
    expected = [2, len(block_ids), *local.shape[2:]]
    dtype = str(local.dtype).removeprefix("torch.")
    layer_bytes = local[:, : len(block_ids)].numel() * local.element_size()
    if len(frames) != len(kv_caches) or header.dtype != dtype or header.shape != expected:
        return (f"the remote KV is {len(frames)} layers of {header.shape} {header.dtype}; "
                f"this worker needs {len(kv_caches)} layers of {expected} {dtype}")
    if any(len(frame.buffer) != layer_bytes for frame in frames):
        return f"the remote layers are not {layer_bytes} bytes each"
    index = torch.tensor(block_ids, dtype=torch.long, device=local.device)
    for frame, cache in zip(frames, kv_caches, strict=True):
        remote = torch.frombuffer(frame.buffer, dtype=local.dtype).view(expected)
        cache.index_copy_(1, index, remote.to(cache.device))
    return None


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory, without a copy (any dtype, bfloat16 included)."""
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


class WorkerKVTransfer:
    """One worker's part in KV transfer: a server (producer), a puller (consumer), or both."""

    def __init__(self, config: KVTransferConfig, rank: int, first_port: int, max_blocks: int):
        """`rank`: in the replica; `first_port`: this worker's fixed port (0: a free one);
        `max_blocks`: the most blocks one request holds."""
        self.server = KVExportServer(config.kv_ip, first_port) if config.is_producer else None
        self.puller = KVPuller(rank, config.transfer_timeout_s, max_blocks) if config.is_consumer else None
        self._pending: list[str] = []
        """Requests whose pull started and was not reported yet, in the plans' order (the same on every worker)."""
        self._ended: dict[str, str | None] = {}
        """Pulls of this worker that ended: None, or why they failed."""
        self._changed = threading.Condition()

    @property
    def address(self) -> str | None:
        return self.server.address if self.server is not None else None

    def step(self, scheduler_output: SchedulerOutput, kv_caches: list[torch.Tensor]
             ) -> tuple[list[str], dict[str, str]]:
        """Apply the step's exports and releases and start its pulls; the pulls that ended on
        every worker of the tensor-parallel group: (those that filled their blocks, those that
        failed on some worker with why). Every worker runs this with the same plan."""
        if self.server is not None:
            self.server.kv_caches = kv_caches
            self.server.apply(scheduler_output.kv_exports, scheduler_output.kv_export_releases)
        for load in scheduler_output.kv_loads:
            self._pending.append(load.request_id)
            if self.puller is not None:
                self.puller.start(load, kv_caches, self._pull_ended)
            else:
                self._pull_ended(load.request_id, "this instance is no consumer")
        if not self._pending:
            return [], {}
        if not scheduler_output.num_scheduled_tokens:
            self._wait_for_any_pull()
        return self._agreed(kv_caches[0].device)

    def _pull_ended(self, request_id: str, why: str | None) -> None:
        if why is not None:
            logger.warning("KV of %s not loaded: %s", request_id, why)
        with self._changed:
            self._ended[request_id] = why
            self._changed.notify_all()

    def _wait_for_any_pull(self) -> None:
        with self._changed:
            self._changed.wait_for(lambda: any(r in self._ended for r in self._pending), LOAD_POLL_S)

    def _agreed(self, device: torch.device) -> tuple[list[str], dict[str, str]]:
        """The pending pulls that ended on every worker (an all-reduce over the group)."""
        with self._changed:
            ended = [(r in self._ended, self._ended.get(r)) for r in self._pending]
        counts = torch.tensor([[not has_ended for has_ended, _ in ended], [why is not None for _, why in ended]],
                              dtype=torch.int32, device=device)
        running_anywhere, failed_anywhere = get_tp_group().all_reduce(counts).tolist()
        done, failed, still_pending = [], {}, []
        for request_id, (_, why), running, failures in zip(self._pending, ended, running_anywhere, failed_anywhere,
                                                             strict=True):
            if running:
                still_pending.append(request_id)
                continue
            with self._changed:
                self._ended.pop(request_id, None)
            if failures:
                failed[request_id] = why or "the pull failed on another worker"
            else:
                done.append(request_id)
        self._pending = still_pending
        return done, failed

    def close(self) -> None:
        for part in (self.server, self.puller):
            if part is not None:
                part.close()
