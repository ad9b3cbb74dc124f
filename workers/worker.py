"""One worker: device, model shard, KV cache and model runner.

`Worker` is the in-process object (the `uni` executor holds one directly); the
worker process around it, which the `mp` executor starts and which serves the
steps of its broadcast socket, is core/launch/worker_process.py.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from fleet.config.fleet import FleetConfig
from fleet.core.kv_blocks import blocks_per_sequence, holds_a_full_sequence
from fleet.core.messages import (
    ModelRunnerOutput,
    SchedulerOutput,
)
from fleet.kernels.gguf_types import describe_holding
from fleet.workers import cpu_dtype, cpu_heap

logger = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: FleetConfig, *, dp_rank: int, replica_rank: int, device: str, num_local_workers: int,
                 kv_cache_bytes: int | None, store: tuple[str, int] | None = None, shows_progress: bool = True):
        """`replica_rank`: pp * TP + tp within data-parallel replica `dp_rank`.
        `num_local_workers`: the workers that share this node's CPU cores.
        `kv_cache_bytes`: this worker's KV cache budget (the node's memory plan
        or --kv-cache-memory-bytes); None profiles the device (CUDA).
        `store`: the host and port of the TCPStore where the workers of its world
        meet (None: a world of one)."""
        from fleet.parallel.dims import driver_rank
        from fleet.parallel.groups import init_worker_groups
        from fleet.workers.loader import load_model
        from fleet.workers.model_runner import TORCH_DTYPES, ModelRunner

        self.config = config
        rank = replica_rank
        self.kv_cache_bytes = kv_cache_bytes
        self.device = _init_device(device, num_local_workers)
        started = time.monotonic()
        store_host, store_port = store or (None, 0)
        init_worker_groups(config, dp_rank, rank, store_host, store_port)
        if store is not None:
            logger.info("joined the process group at %s:%d in %.1f s", store_host, store_port,
                        time.monotonic() - started)
        torch.manual_seed(config.model.seed)
        dtype = TORCH_DTYPES[config.model.dtype]
        if self.device.type == "cpu" and rank == 0:
            cpu_dtype.warn_if_bfloat16_is_emulated(dtype)
        started = time.monotonic()
        model = load_model(config.model, config.load, dtype, self.device, show_progress=shows_progress)
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
            port = kv.kv_port and kv.kv_port + dp_rank * config.parallel.replica_size + rank
            max_blocks = blocks_per_sequence(config.model.max_model_len, config.cache.block_size)
            self.runner.kv_transfer = WorkerKVTransfer(kv, rank, port, max_blocks)
        if self.device.type == "cpu":
            from fleet.kernels.cpu_extension import cpu_kernels

            cpu_kernels()  # build or load the fused CPU kernels now, not in the first request
            if rank == 0:
                cpu_dtype.log_cpu_paths(config.model)

    def available_kv_blocks(self) -> int:
        budget = self._kv_cache_budget_bytes()
        num_blocks = budget // self.runner.kv_bytes_per_block()
        max_model_len, block_size = self.config.model.max_model_len, self.config.cache.block_size
        if not holds_a_full_sequence(num_blocks, max_model_len, block_size):
            needed = blocks_per_sequence(max_model_len, block_size)
            raise ValueError(
                f"the KV cache holds {num_blocks} blocks ({budget} bytes) but one sequence of "
                f"--max-model-len {max_model_len} needs {needed}: "
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


def _init_device(name: str, num_local_workers: int) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        return device
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, cores // num_local_workers))
    cpu_heap.fix_mmap_threshold()
    return torch.device("cpu")
