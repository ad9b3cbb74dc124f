"""One worker: device, model shard, KV cache and model runner.

`Worker` is the in-process object (the `uni` executor holds one directly);
`python -m fleet.workers.worker` is the worker process that the `mp`
executor starts: it receives each SchedulerOutput on a broadcast socket and, if it
is the driver, returns the runner output.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback

import torch
import zmq

from fleet.config.fleet import FleetConfig
from fleet.core import ipc, processes, serial
from fleet.core.messages import (
    KVCapacity,
    ModelRunnerOutput,
    Ready,
    SchedulerOutput,
    Shutdown,
    WorkerDead,
    WorkerInput,
    WorkerUtilityCall,
    WorkerUtilityResult,
)
from fleet.core.node_plan import StoreLocation, WorkerPlan
from fleet.kernels.gguf_types import describe_holding
from fleet.workers import cpu_dtype, cpu_heap
from fleet.workers.executor import WorkerStartupInfo

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: FleetConfig, plan: WorkerPlan, store: StoreLocation | None = None):
        """`plan.kv_cache_bytes`: this worker's KV cache budget (the node's memory
        plan or --kv-cache-memory-bytes); None profiles the device (CUDA).
        `store`: where the workers of its world meet (None: a world of one)."""
        from fleet.parallel.dims import driver_rank
        from fleet.parallel.groups import init_worker_groups
        from fleet.workers.loader import load_model
        from fleet.workers.model_runner import TORCH_DTYPES, ModelRunner

        self.config = config
        rank = plan.replica_rank
        self.kv_cache_bytes = plan.kv_cache_bytes
        self.device = _init_device(plan)
        started = time.monotonic()
        init_worker_groups(config, plan.dp_rank, rank, store)
        if store is not None:
            logger.info("joined the process group at %s:%d in %.1f s", store.host, store.port,
                        time.monotonic() - started)
        torch.manual_seed(config.model.seed)
        dtype = TORCH_DTYPES[config.model.dtype]
        if self.device.type == "cpu" and rank == 0:
            cpu_dtype.warn_if_bfloat16_is_emulated(dtype)
        started = time.monotonic()
        model = load_model(config.model, config.load, dtype, self.device, show_progress=plan.rank == 0)
        weight_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
        holding = getattr(model, "gguf_holding", None)  # how a GGUF file's tensors are held, type by type
        logger.info("loaded %s (%s, %s) in %.1f s: %.2f GiB of weights on %s%s", config.model.model,
                    config.model.architecture, config.model.dtype, time.monotonic() - started, weight_bytes / 2**30,
                    self.device, f"; GGUF tensors: {describe_holding(holding, config.model.dtype, dtype.itemsize)}"
                    if holding else "")
        self.is_driver = rank == driver_rank(config.parallel)
        self.runner = ModelRunner(config, model, self.device, self.is_driver)
        if config.kv_transfer is not None:
            from fleet.workers.kv_transfer import WorkerKVTransfer

            kv = config.kv_transfer
            port = kv.kv_port and kv.kv_port + plan.dp_rank * config.parallel.replica_size + rank
            max_blocks = -(-config.model.max_model_len // config.cache.block_size)
            self.runner.kv_transfer = WorkerKVTransfer(kv, rank, port, max_blocks)
        if self.device.type == "cpu":
            from fleet.kernels.cpu_extension import cpu_kernels

            cpu_kernels()  # build or load the fused CPU kernels now, not in the first request
            if rank == 0:
                cpu_dtype.log_cpu_paths(config.model)

    def available_kv_blocks(self) -> int:
        budget = self._kv_cache_budget_bytes()
        num_blocks = budget // self.runner.kv_bytes_per_block()
        needed = -(-self.config.model.max_model_len // self.config.cache.block_size)
        if num_blocks < needed:
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({budget} bytes) but one sequence of "
                f"--max-model-len {self.config.model.max_model_len} needs {needed}: "
                "raise --kv-cache-memory-bytes / --gpu-memory-utilization or lower --max-model-len"
            )
        return int(num_blocks)

    def _kv_cache_budget_bytes(self) -> int:
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if self.device.type != "cuda":
            raise ValueError("a CPU worker needs its KV cache budget from the node's memory plan")
        free, total = torch.cuda.mem_get_info(self.device)
        reserve = total * (1 - self.config.cache.gpu_memory_utilization)
        return int(max(free - reserve, 0) * 0.9)  # 10 % headroom for activations

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.allocate_kv_cache(num_blocks)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.runner.execute(scheduler_output)
        going_idle = scheduler_output.finished_request_ids and not scheduler_output.num_scheduled_tokens
        if self.device.type == "cpu" and going_idle:
            cpu_heap.return_free_pages()  # the last requests finished: the engine goes idle
        return output

    def utility(self, method: str, args: list) -> object:
        if method == "init_kv_cache":
            return self.init_kv_cache(*args)
        raise ValueError(f"unknown worker utility {method!r}")


def _init_device(plan: WorkerPlan) -> torch.device:
    device = torch.device(plan.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return device
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // plan.num_local_workers))
    cpu_heap.fix_mmap_threshold()
    return torch.device("cpu")


# ---- the worker process --------------------------------------------------------------


def serve_worker(name: str, info: WorkerStartupInfo) -> None:
    """Build the worker, report Ready (or the error) to the executor, then
    serve scheduler outputs until Shutdown. A worker process's whole life, and a
    Ray worker actor's."""
    ctx = zmq.Context()

    def build() -> tuple[Worker, zmq.Socket, zmq.Socket | None, KVCapacity]:
        worker = Worker(info.config, info.plan, info.store)
        steps = ipc.make_socket(ctx, zmq.SUB, connect=info.step_address)
        steps.setsockopt(zmq.SUBSCRIBE, b"")
        results = ipc.make_socket(ctx, zmq.PUSH, connect=info.result_address) if worker.is_driver else None
        return worker, steps, results, KVCapacity(worker.available_kv_blocks(), info.config.cache.block_size)

    worker, steps, results, capacity = processes.start_or_report(name, info.handshake_address, build)
    kv_export = worker.runner.kv_transfer.address if worker.runner.kv_transfer else None
    addresses = {"kv_export": kv_export} if kv_export else {}
    processes.report(info.handshake_address, Ready(name, os.getpid(), kv_capacity=capacity, addresses=addresses))
    _serve(worker, info.plan.replica_rank, name, steps, results)


def _serve(worker: Worker, rank: int, name: str, steps: zmq.Socket, results: zmq.Socket | None) -> None:
    decoder = serial.Decoder(WorkerInput, f"{name} steps")
    while True:
        message = decoder.decode(steps.recv())
        try:
            match message:
                case SchedulerOutput():
                    output = worker.execute(message)
                    if results is not None and output is not None:
                        results.send(serial.encode(output))
                case WorkerUtilityCall(call_id=call_id, method=method, args=args):
                    result = worker.utility(method, args)
                    if results is not None:
                        results.send(serial.encode(WorkerUtilityResult(call_id, result)))
                case Shutdown():
                    return
        except Exception as error:
            logger.exception("%s failed", name)
            if results is not None:
                results.send(serial.encode(WorkerDead(rank, f"{name}: {type(error).__name__}: {error}")))
            traceback.print_exc()
            sys.exit(1)


def main() -> None:
    processes.child_main(WorkerStartupInfo, serve_worker)


if __name__ == "__main__":
    main()
