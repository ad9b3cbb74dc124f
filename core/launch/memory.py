"""The memory budget of one node's CPU workers, owned by the node's launcher.

On the CPU every worker of a node shares one RAM. One budget is computed for
the node from its total memory (deterministic: `fleet plan`, the launcher and
each worker compute the same numbers) and divided among its local workers:

    fleet's share     = --gpu-memory-utilization x node memory
    fixed             = per worker: weights + activations + runtime,
                        plus the launcher, API servers, engines, coordinator
    KV cache, node    = min(KV_SHARE_OF_NODE x node memory, fleet's share - fixed)
    KV cache, worker  = min(KV cache node / local workers,
                            what the launch can use: --max-num-seqs sequences
                            of --max-model-len tokens, in blocks)

Weights and activations are estimated from the model's config, without
reading weights. The launcher also checks that the whole footprint fits in the
memory free now (`check_fits`), so a launch that cannot fit fails at once
with the flags to change instead of being killed by the OOM killer later.
With --kv-cache-memory-bytes the user sets each worker's KV cache; on CUDA it
is profiled on the device by each worker. This module imports no torch.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import psutil

from fleet.config.fleet import FleetConfig
from fleet.config.parallel import ParallelConfig
from fleet.core import kv_blocks
from fleet.kernels.gguf_types import DEQUANTIZE_SCRATCH_BYTES, TypeHolding, planned_holding
from fleet.parallel.dims import node_engine_ranks, node_worker_ranks, runs_api_servers, runs_dp_coordinator
from fleet.workers.gguf_file import read_gguf_tensors

KV_SHARE_OF_NODE = 0.4
"""At most this share of the node's memory goes to KV caches by default: two
default launches on one node then still fit when both caches are full."""

WORKER_RUNTIME_BYTES = 512 * 2**20
"""A worker's Python, torch and CPU kernels besides weights, activations and
KV cache (measured about 260 MiB resident for the default model)."""

COMPILED_DECODE_BYTES = 256 * 2**20
"""More per worker with --compilation-config mode torch_compile: Dynamo,
Inductor and the compiled graphs (measured 245 MiB more resident for the
default model: 584 MiB instead of 339)."""

SERVICE_PROCESS_BYTES = 384 * 2**20
"""Each launcher, API server, engine core or coordinator (measured for the default model:
launcher 52 MiB, API server 320 MiB, engine core 32 MiB resident)."""

SANDBOX_PROCESS_BYTES = 128 * 2**20
"""Each API server's sandbox process (frontend/sandbox.py; measured for the
default model: 32 MiB idle, 84 MiB once it has loaded the tokenizer to check a
grammar). A hostile render may briefly take up to --sandbox-memory-bytes
before it is refused; that is not budgeted."""

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
ACTIVATION_BYTES = 4
"""Activations are budgeted as float32: logits and sampling run in it."""


class WorkerMemory(NamedTuple):
    """Bytes one worker of this node uses; kv_cache is its KV cache budget."""

    weights: int
    activations: int
    runtime: int
    kv_cache: int

    @property
    def total(self) -> int:
        return self.weights + self.activations + self.runtime + self.kv_cache


class NodeMemory(NamedTuple):
    """The memory plan of one node (CPU workers)."""

    node_bytes: int
    """The node's memory: physical RAM, or the cgroup's limit when lower."""
    num_workers: int
    num_service_processes: int
    num_sandbox_processes: int
    worker: WorkerMemory
    kv_cache_source: str
    """How each worker's KV cache was sized: the flag, the node's share, or the launch's use."""
    response_store_bytes: int = 0
    """The API servers' stored responses (--max-stored-response-bytes each)."""

    @property
    def footprint(self) -> int:
        """Everything this launch may use on the node once its KV caches are full."""
        return self.num_workers * self.worker.total + self.service_bytes

    @property
    def service_bytes(self) -> int:
        """The launcher, API servers (their stored responses too), engines, coordinator and sandbox processes."""
        return (self.num_service_processes * SERVICE_PROCESS_BYTES + self.num_sandbox_processes * SANDBOX_PROCESS_BYTES
                + self.response_store_bytes)

    def summary(self) -> dict[str, object]:
        """What `fleet plan` shows."""
        return {
            "node_bytes": self.node_bytes,
            "workers": self.num_workers,
            "service_processes": self.num_service_processes,
            "sandbox_processes": self.num_sandbox_processes,
            "response_store_bytes": self.response_store_bytes,
            "per_worker": self.worker._asdict(),
            "kv_cache_per_worker": human_bytes(self.worker.kv_cache),
            "kv_cache_sized_by": self.kv_cache_source,
            "footprint_bytes": self.footprint,
            "footprint": human_bytes(self.footprint),
        }


def node_memory(config: FleetConfig, node_bytes: int | None = None, num_workers: int | None = None) -> NodeMemory:
    """This node's memory plan. `num_workers` defaults to the launch's
    workers on this node. Raises ValueError, naming the flags to change, when
    one sequence of --max-model-len does not fit a worker's KV cache."""
    node_bytes = node_memory_bytes() if node_bytes is None else node_bytes
    parallel = config.parallel
    workers = len(node_worker_ranks(parallel)) if num_workers is None else num_workers
    services, sandboxes = num_service_processes(config), num_sandbox_processes(config)
    stores = num_api_servers(config) * config.frontend.max_stored_response_bytes
    weights, activations = worker_weight_bytes(config), worker_activation_bytes(config)
    runtime = WORKER_RUNTIME_BYTES + (COMPILED_DECODE_BYTES if config.compilation.mode == "torch_compile" else 0)
    fixed = WorkerMemory(weights, activations, runtime, 0)
    if config.cache.kv_cache_memory_bytes is not None:
        kv_cache, source = int(config.cache.kv_cache_memory_bytes), "--kv-cache-memory-bytes"
    else:
        fleet_share = config.cache.gpu_memory_utilization * node_bytes
        spare = (fleet_share - workers * fixed.total - services * SERVICE_PROCESS_BYTES
                 - sandboxes * SANDBOX_PROCESS_BYTES - stores)
        node_kv = max(0.0, min(KV_SHARE_OF_NODE * node_bytes, spare))
        kv_cache, source = int(node_kv // max(workers, 1)), "the node's share"
        usable = usable_kv_cache_bytes(config)
        if usable <= kv_cache:
            kv_cache, source = usable, "--max-num-seqs x --max-model-len"
    plan = NodeMemory(node_bytes, workers, services, sandboxes, fixed._replace(kv_cache=kv_cache), source, stores)
    _check_one_sequence_fits(config, plan)
    return plan


def planned_kv_cache_bytes(config: FleetConfig) -> int | None:
    """Each worker's KV cache budget: --kv-cache-memory-bytes, else on the CPU
    the node's plan; None on CUDA, where each worker profiles its device."""
    if config.cache.kv_cache_memory_bytes is not None:
        return int(config.cache.kv_cache_memory_bytes)
    if config.device.device == "cuda":
        return None
    return node_memory(config).worker.kv_cache


def num_api_servers(config: FleetConfig) -> int:
    return config.frontend.api_server_count if runs_api_servers(config.parallel) else 0


def num_service_processes(config: FleetConfig) -> int:
    """Processes of this node besides its workers: the launcher, API servers, engines, coordinator."""
    parallel = config.parallel
    return 1 + num_api_servers(config) + len(node_engine_ranks(parallel)) + int(runs_dp_coordinator(parallel))


def num_sandbox_processes(config: FleetConfig) -> int:
    """The sandbox processes of this node's API servers."""
    return num_api_servers(config) * config.frontend.sandbox_processes


def _check_one_sequence_fits(config: FleetConfig, plan: NodeMemory) -> None:
    length, block_size, per_block = config.model.max_model_len, config.cache.block_size, kv_bytes_per_block(config)
    if kv_blocks.holds_a_full_sequence(plan.worker.kv_cache // per_block, length, block_size):
        return
    needed = per_block * blocks_per_sequence(config)
    if plan.kv_cache_source == "--kv-cache-memory-bytes":
        raise ValueError(
            f"--kv-cache-memory-bytes {human_bytes(plan.worker.kv_cache)} holds less than one sequence of "
            f"--max-model-len {length}, which needs {human_bytes(needed)} per worker: raise it or lower --max-model-len"
        )
    raise ValueError(
        f"each of this node's {plan.num_workers} workers gets {human_bytes(plan.worker.kv_cache)} of KV cache "
        f"(at most {KV_SHARE_OF_NODE:.0%} of the node's {human_bytes(plan.node_bytes)}, after "
        f"{human_bytes(plan.worker.weights + plan.worker.activations + plan.worker.runtime)} per worker for weights, "
        f"activations and runtime), but one sequence of --max-model-len {length} needs {human_bytes(needed)}: "
        "lower --max-model-len, run fewer workers on this node (--tp, --pp, --dp), "
        "or set --kv-cache-memory-bytes"
    )


def check_fits(plan: NodeMemory, free_bytes: int | None = None) -> None:
    """Raise ValueError, naming the flags to change, when this launch's
    footprint exceeds the memory free on the node now."""
    free_bytes = free_memory_bytes() if free_bytes is None else free_bytes
    if plan.footprint <= free_bytes:
        return
    worker = plan.worker
    raise ValueError(
        f"this launch needs {human_bytes(plan.footprint)} of memory on this node "
        f"but {human_bytes(free_bytes)} is free: "
        f"{plan.num_workers} worker(s) x (weights {human_bytes(worker.weights)} + activations "
        f"{human_bytes(worker.activations)} + runtime {human_bytes(worker.runtime)} + KV cache "
        f"{human_bytes(worker.kv_cache)}) + {plan.num_service_processes} other processes x "
        f"{human_bytes(SERVICE_PROCESS_BYTES)} + {plan.num_sandbox_processes} sandbox processes x "
        f"{human_bytes(SANDBOX_PROCESS_BYTES)}; lower --kv-cache-memory-bytes, --max-num-batched-tokens or "
        "--max-num-seqs, run fewer workers on this node (--tp, --pp, --dp), or stop other launches"
    )


# ---- what one worker holds ----------------------------------------------------------


class _Shape(NamedTuple):
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int


def _shape(config: FleetConfig) -> _Shape:
    hf = config.model.hf_config
    hidden, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    return _Shape(
        hidden=hidden,
        layers=int(hf["num_hidden_layers"]),
        heads=heads,
        kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or hidden // heads),
        vocab=int(hf["vocab_size"]),
        intermediate=int(hf.get("intermediate_size") or 4 * hidden),
    )


def _layers_per_stage(config: FleetConfig) -> int:
    return math.ceil(_shape(config).layers / config.parallel.pipeline_parallel_size)


def kv_heads_per_rank(config: FleetConfig) -> int:
    """KV heads are split over tensor parallel, or replicated when fewer than its size."""
    return max(1, _shape(config).kv_heads // config.parallel.tensor_parallel_size)


def kv_bytes_per_block(config: FleetConfig) -> int:
    """Bytes of one KV block on the worker with the most layers (keys and values)."""
    return kv_blocks.kv_bytes_per_block(config.cache.block_size, kv_heads_per_rank(config), _shape(config).head_dim,
                                        _layers_per_stage(config), DTYPE_BYTES[config.model.dtype])


def blocks_per_sequence(config: FleetConfig) -> int:
    return kv_blocks.blocks_per_sequence(config.model.max_model_len, config.cache.block_size)


def usable_kv_cache_bytes(config: FleetConfig) -> int:
    """The most KV cache a worker can use: --max-num-seqs sequences of --max-model-len tokens."""
    return config.scheduler.max_num_seqs * blocks_per_sequence(config) * kv_bytes_per_block(config)


def worker_weight_bytes(config: FleetConfig) -> int:
    """Weights of one worker's shard, estimated from the model's config:
    its pipeline stage's layers, sliced over tensor parallel (experts over
    expert parallel), plus the vocabulary's embedding and head slices."""
    shape, parallel, hf = _shape(config), config.parallel, config.model.hf_config
    tp, pp = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
    attention = shape.hidden * shape.head_dim * (2 * shape.heads + 2 * shape.kv_heads)
    num_experts = config.model.num_experts
    if num_experts:
        expert_size = int(hf.get("moe_intermediate_size") or shape.intermediate)
        experts = num_experts * 3 * shape.hidden * expert_size
        shared = 3 * shape.hidden * int(hf.get("shared_expert_intermediate_size") or 0)
        expert_split = _expert_parallel_size(parallel) if parallel.enable_expert_parallel else tp
        layer = attention / tp + experts / expert_split + shared / tp + shape.hidden * num_experts
    else:
        layer = (attention + 3 * shape.hidden * shape.intermediate) / tp
    vocab_tables = 1 if hf.get("tie_word_embeddings") else 2
    embedding = vocab_tables * shape.vocab * shape.hidden / tp / min(pp, vocab_tables)
    count = layer * _layers_per_stage(config) + embedding
    decode_copy = 1.0
    if config.model.keeps_bfloat16_decode_weights(config.device.device):
        # The bfloat16 copy for decode steps (kernels/linear.py): at most half
        # again a float32 model, as much again a bfloat16 one.
        decode_copy = 2 if config.model.dtype == "bfloat16" else 1.5
    if config.model.is_gguf:
        # The file's tensors as the worker holds them (kernels/quantized.py):
        # the file's bytes for blocks kept, and on AMX their bfloat16 copy for
        # large steps; the dtype's for the rest, with its decode copy. This
        # worker's share of them is its share of the weights.
        whole = tp * (layer * shape.layers) + vocab_tables * shape.vocab * shape.hidden
        held = gguf_holding(config).values()
        amx_copy = DTYPE_BYTES["bfloat16"] if config.model.keeps_amx_gemm_copies(config.device.device) else 0
        weights = sum(h.kept_bytes + h.kept_weights * amx_copy
                      + h.dequantized_weights * DTYPE_BYTES[config.model.dtype] * decode_copy for h in held)
        return int(weights * count / whole)
    return int(count * DTYPE_BYTES[config.model.dtype] * decode_copy)


def gguf_holding(config: FleetConfig) -> dict[str, TypeHolding]:
    """How a worker will hold the GGUF file's tensors, type by type (kept in
    their blocks or loaded as the dtype), read from the file's tensor index."""
    device = config.device.device
    tensors = ((t.gguf_type, t.shape, t.data.nbytes) for t in read_gguf_tensors(config.model.model_path))
    return planned_holding(tensors, device, config.model.keeps_gguf_blocks(device))


def gguf_holding_summary(config: FleetConfig) -> dict[str, dict[str, int]] | None:
    """What `fleet plan` shows of it (None for a model that is no GGUF file)."""
    if not config.model.is_gguf:
        return None
    dtype = config.model.dtype
    return {name: held.summary(dtype, DTYPE_BYTES[dtype]) for name, held in gguf_holding(config).items()}


def _expert_parallel_size(parallel: ParallelConfig) -> int:
    return parallel.data_parallel_size * parallel.tensor_parallel_size


def worker_activation_bytes(config: FleetConfig) -> int:
    """Temporaries of the largest step: --max-num-batched-tokens through a
    layer (hidden states, q/k/v, the MLP's gate and up projections) and the
    logits of --max-num-seqs rows with their sampling copies; for a GGUF
    file, the buffer a K-quant prefill dequantizes its weights into."""
    shape, tp = _shape(config), config.parallel.tensor_parallel_size
    tokens, rows = config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs
    qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim / tp
    per_token = 8 * shape.hidden + 3 * shape.intermediate / tp + 2 * qkv
    scratch = DEQUANTIZE_SCRATCH_BYTES if config.model.is_gguf else 0  # a K-quant prefill's dequantized weights
    return int((tokens * per_token + 3 * rows * shape.vocab) * ACTIVATION_BYTES) + scratch


# ---- the node -------------------------------------------------------------------------


def node_memory_bytes() -> int:
    """Physical memory, or the cgroup's memory limit when it is lower."""
    total = psutil.virtual_memory().total
    limit = _cgroup_limit()
    return min(total, limit) if limit else total


def free_memory_bytes() -> int:
    """Memory free for a new launch now. Linux counts memory that other
    processes reserved but have not touched yet (another launch's KV cache,
    which fills as it caches tokens) in Committed_AS: it is taken as used."""
    free = psutil.virtual_memory().available
    meminfo = _meminfo()
    if "Committed_AS" in meminfo:
        free = min(free, node_memory_bytes() - meminfo["Committed_AS"])
    limit = _cgroup_limit()
    if limit:
        free = min(free, limit - _cgroup_usage())
    return max(free, 0)


def _meminfo() -> dict[str, int]:
    try:
        with open("/proc/meminfo") as f:
            return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.rstrip().endswith("kB")}
    except OSError:
        return {}


def _cgroup_limit() -> int:
    """The memory limit of this process's cgroup (v2 or v1), or 0 when none is set."""
    value = _read_cgroup_value("memory.max", "memory.limit_in_bytes")
    return value if 0 < value < 2**60 else 0  # v1 writes "no limit" as a huge number


def _cgroup_usage() -> int:
    return _read_cgroup_value("memory.current", "memory.usage_in_bytes")


def _read_cgroup_value(v2_name: str, v1_name: str) -> int:
    """A number from this process's memory cgroup (0 when unreadable or "max")."""
    candidates = []
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, controllers, path = line.rstrip("\n").split(":", 2)
                if controllers == "":
                    candidates.append(f"/sys/fs/cgroup{path}/{v2_name}")
                elif "memory" in controllers.split(","):
                    candidates.append(f"/sys/fs/cgroup/memory{path}/{v1_name}")
    except (OSError, ValueError):
        pass
    candidates += [f"/sys/fs/cgroup/{v2_name}", f"/sys/fs/cgroup/memory/{v1_name}"]
    for candidate in candidates:
        try:
            with open(candidate) as f:
                value = f.read().strip()
        except OSError:
            continue
        return int(value) if value.isdigit() else 0
    return 0


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1024
    return f"{count:.2f} TiB"
