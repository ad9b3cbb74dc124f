"""EngineArgs: the flat, user-facing fields of every config class, and their
resolution into one immutable FleetConfig."""
from __future__ import annotations

import dataclasses
import os
import typing
from typing import Any, Literal

from fleet.config import env
from fleet.config.cache import CacheConfig
from fleet.config.compilation import CompilationConfig
from fleet.config.cpu_class import cpu_class, cpu_computes_bfloat16
from fleet.config.device import DeviceConfig
from fleet.config.fields import HumanInt, HumanReadable, parse_human_int
from fleet.config.fleet import FleetConfig
from fleet.config.frontend import FrontendConfig
from fleet.config.kv_transfer import KVTransferConfig
from fleet.config.load import LoadConfig
from fleet.config.model import (
    DEFAULT_MODEL,
    DEFAULT_MODEL_ALIAS,
    ModelConfig,
    ModelDtype,
    checkpoint_dtype,
    sliding_windows,
)
from fleet.config.model_files import is_default_model, locate_model, read_generation_config, read_hf_config
from fleet.config.parallel import ParallelConfig
from fleet.config.scheduler import SchedulerConfig
from fleet.config.speculative import SpeculativeConfig

# Config classes whose user-facing fields EngineArgs flattens, in --help order.
FLAT_GROUPS: dict[str, type] = {
    "model": ModelConfig,
    "parallel": ParallelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "load": LoadConfig,
    "device": DeviceConfig,
    "frontend": FrontendConfig,
}
# Config classes that EngineArgs holds whole, as one JSON-valued flag each.
NESTED_GROUPS: dict[str, type] = {"compilation_config": CompilationConfig, "kv_transfer_config": KVTransferConfig,
                                  "speculative_config": SpeculativeConfig}

# Limits by device when the user sets none: CPU steps are slow, so smaller steps keep latency down.
DEFAULT_MAX_NUM_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}
DEFAULT_MAX_NUM_SEQS = {"cpu": 128, "cuda": 256}
PROMPT_CHARS_PER_TOKEN = 32
"""Unset --max-prompt-chars: a token is rarely 32 characters, so a longer text cannot fit the context."""
MIN_SANDBOX_MEMORY_BYTES = 256 * 2**20
CONTEXT_LENGTH_KEYS = ("max_position_embeddings", "max_seq_len", "n_positions", "seq_length")


def user_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of a config class that the user sets (not those resolution fills in)."""
    return [f for f in dataclasses.fields(cls) if not f.metadata.get("resolved")]


def _is_human_int(hint: Any) -> bool:
    """HumanInt, or HumanInt | None."""
    candidates = [hint, *typing.get_args(hint)]
    return any(HumanReadable in getattr(c, "__metadata__", ()) for c in candidates)


HUMAN_INT_FIELDS = [
    f.name
    for cls in FLAT_GROUPS.values()
    for f in user_fields(cls)
    if _is_human_int(typing.get_type_hints(cls, include_extras=True)[f.name])
]


@dataclasses.dataclass
class EngineArgs:
    """Every user-facing field of every config class, flat, as the CLI and
    fleet.LLM take them, under the name of the flag (`--tensor-parallel-size`
    is `tensor_parallel_size`). Each group mirrors the user fields of the
    config class it names, types and defaults included, and
    tests/config/test_engine_args.py keeps the two in step: a field added to a
    config class is added here too."""

    # model: ModelConfig
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None
    served_model_name: list[str] | None = None
    dtype: ModelDtype = "auto"
    max_model_len: HumanInt | None = None
    seed: int = 0
    max_logprobs: int = 20
    pooling_type: Literal["last", "mean"] = "last"
    disable_sliding_window: bool = False
    generation_config: str = "auto"
    # parallel: ParallelConfig
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_rank: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int = 29550
    data_parallel_hybrid_lb: bool = False
    data_parallel_external_lb: bool = False
    data_parallel_routing: Literal["least-loaded", "cache-aware", "round-robin"] = "cache-aware"
    data_parallel_backend: Literal["mp", "ray"] = "mp"
    distributed_executor_backend: Literal["uni", "mp", "ray"] = "mp"
    ray_address: str | None = None
    enable_expert_parallel: bool = False
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    headless: bool = False
    distributed_timeout_seconds: int = 300
    replica_restart_policy: Literal["never", "always", "on-failure"] = "on-failure"
    max_replica_restarts: int = 5
    engine_step_timeout: float = 300.0
    disaggregate: str | None = None
    # cache: CacheConfig
    block_size: int = 16
    kv_cache_memory_bytes: HumanInt | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool | None = None
    # scheduler: SchedulerConfig
    max_num_batched_tokens: HumanInt | None = None
    max_num_seqs: int | None = None
    enable_chunked_prefill: bool | None = None
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # load: LoadConfig
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = "auto"
    download_dir: str | None = None
    # device: DeviceConfig
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # frontend: FrontendConfig
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: list[str] | None = None
    api_server_count: int = 1
    max_request_body_bytes: HumanInt = 8 * 2**20
    metrics_require_key: bool = False
    http_header_timeout: float = 10.0
    http_keep_alive_timeout: float = 5.0
    max_connections: int = 1000
    shutdown_timeout: float = 10.0
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "warning"
    chat_template: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: Literal["hermes", "llama3_json"] | None = None
    trust_request_chat_template: bool = False
    max_prompt_chars: HumanInt | None = None
    max_tools: int = 128
    max_inputs_per_request: int = 2048
    max_request_tokens: HumanInt = 128 * 2**10
    max_structured_choices: int = 4096
    sandbox_processes: int = 2
    sandbox_timeout: float = 3.0
    sandbox_memory_bytes: HumanInt = 2**30
    root_path: str | None = None
    disable_fastapi_docs: bool = False
    max_stored_responses: int = 1000
    max_stored_response_bytes: HumanInt = 64 * 2**20
    # compilation_config: one JSON-valued flag
    compilation_config: CompilationConfig = dataclasses.field(default_factory=CompilationConfig)
    kv_transfer_config: KVTransferConfig | None = None
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        # Python callers may write numbers as on the CLI: LLM(kv_cache_memory_bytes="2G").
        for name in HUMAN_INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, parse_human_int(value))
        if isinstance(self.api_key, str):  # LLM(api_key="k") or FLEET_API_KEY: one key
            self.api_key = [self.api_key]
        # ... and a nested group as a dict, as vLLM's LLM takes it: LLM(compilation_config={"mode": ...}).
        for name, cls in NESTED_GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, cls(**value))

    def create_config(self) -> FleetConfig:
        """Resolve every default that depends on the model, the hardware and the
        parallel layout. Raises ValueError naming the flags of any inconsistency."""
        device = DeviceConfig(**self._group("device")).resolve()
        if device.device == "cpu":
            cpu_class()  # refuses a FLEET_CPU_ISA this machine lacks, before anything starts
        load = LoadConfig(**self._group("load"))
        model = _resolve_model(ModelConfig(**self._group("model")), load, device)
        parallel = ParallelConfig(**self._group("parallel")).resolve(is_moe=model.is_moe)
        _check_heads_divide(model, parallel)
        _check_experts_divide(model, parallel)
        scheduler = _resolve_scheduler(SchedulerConfig(**self._group("scheduler")), model, device)
        cache = CacheConfig(**self._group("cache"))
        if cache.enable_prefix_caching is None:
            cache = dataclasses.replace(cache, enable_prefix_caching=True)
        if cache.block_size < 1:
            raise ValueError(f"--block-size must be at least 1, got {cache.block_size}")
        frontend = _resolve_frontend(FrontendConfig(**self._group("frontend")), model)
        self.compilation_config.check_built(device.device, model.is_moe)
        kv_transfer = _resolve_kv_transfer(self.kv_transfer_config, parallel)
        return FleetConfig(
            model=model,
            cache=cache,
            parallel=parallel,
            scheduler=scheduler,
            load=_resolve_load_format(load, model),
            device=device,
            frontend=frontend,
            compilation=self.compilation_config,
            kv_transfer=kv_transfer,
            speculative=self.speculative_config and self.speculative_config.resolve(),
        )

    def _group(self, name: str) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in user_fields(FLAT_GROUPS[name])}


def _resolve_model(model: ModelConfig, load: LoadConfig, device: DeviceConfig) -> ModelConfig:
    path = locate_model(model.model, load.download_dir)
    hf_config = read_hf_config(path)
    architectures = hf_config.get("architectures") or []
    if not architectures:
        raise ValueError(f"--model {model.model!r}: its config names no architectures")
    tokenizer_path = locate_model(model.tokenizer, load.download_dir) if model.tokenizer else path
    served = model.served_model_name or (
        [DEFAULT_MODEL_ALIAS, DEFAULT_MODEL] if is_default_model(model.model) else [model.model]
    )
    return dataclasses.replace(
        model,
        model_path=path,
        tokenizer_path=tokenizer_path,
        architecture=architectures[0],
        hf_config=hf_config,
        served_model_name=served,
        dtype=_resolve_dtype(model.dtype, hf_config, device),
        max_model_len=_resolve_max_model_len(model.max_model_len, hf_config, model.disable_sliding_window),
        eos_token_ids=_eos_token_ids(hf_config, read_generation_config(path)),
        sampling_defaults=_sampling_defaults(model.generation_config, path),
    )


def _resolve_kv_transfer(kv_transfer: KVTransferConfig | None, parallel: ParallelConfig) -> KVTransferConfig | None:
    """--kv-transfer-config, checked; with --disaggregate every replica both prefills and decodes (kv_both)."""
    if parallel.disaggregation is not None:
        if kv_transfer is not None and kv_transfer.kv_role != "kv_both":
            raise ValueError(f"--disaggregate needs --kv-transfer-config kv_role kv_both (or none), "
                             f"got {kv_transfer.kv_role}")
        kv_transfer = kv_transfer or KVTransferConfig(kv_role="kv_both")
    elif kv_transfer is not None and kv_transfer.secret is None:
        # Without it any client could name KV to read and addresses to connect to (README, Security).
        raise ValueError("--kv-transfer-config between separate instances needs kv_connector_extra_config "
                         "secret (the same on every instance and `fleet proxy --kv-transfer-secret`)")
    if kv_transfer is not None:
        kv_transfer.check(parallel.pipeline_parallel_size, parallel.distributed_executor_backend)
    return kv_transfer


def _resolve_frontend(frontend: FrontendConfig, model: ModelConfig) -> FrontendConfig:
    if frontend.api_key is None and env.api_key() is not None:
        frontend = dataclasses.replace(frontend, api_key=[env.api_key()])
    if frontend.chat_template is not None:
        frontend = dataclasses.replace(frontend, chat_template=_read_chat_template(frontend.chat_template))
    if frontend.max_prompt_chars is None:
        frontend = dataclasses.replace(frontend, max_prompt_chars=PROMPT_CHARS_PER_TOKEN * model.max_model_len)
    if frontend.enable_auto_tool_choice and frontend.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or llama3_json)")
    at_least_one = ("api_server_count", "max_connections", "max_prompt_chars", "max_tools", "max_inputs_per_request",
                    "max_request_tokens", "max_structured_choices", "sandbox_processes")
    for name in at_least_one:
        if getattr(frontend, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(frontend, name)}")
    for name in ("max_stored_responses", "max_stored_response_bytes"):
        if getattr(frontend, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 0, got {getattr(frontend, name)}")
    for name in ("sandbox_timeout", "http_header_timeout", "http_keep_alive_timeout"):
        if getattr(frontend, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(frontend, name)}")
    if frontend.sandbox_memory_bytes < MIN_SANDBOX_MEMORY_BYTES:
        raise ValueError(f"--sandbox-memory-bytes must be at least {MIN_SANDBOX_MEMORY_BYTES >> 20}M (the process "
                         f"and the tokenizer it checks grammars with), got {frontend.sandbox_memory_bytes}")
    return frontend


def _read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the value itself when it is a Jinja template.
    Resolved here so that every process (on any node) gets the text."""
    if os.path.isfile(value):
        with open(value) as f:
            return f.read()
    if "{" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
"""generation_config.json keys that become sampling defaults, and the SamplingParams field of each (vLLM's set)."""


def _eos_token_ids(*configs: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for config in configs:
        eos = config.get("eos_token_id")
        for token in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(token) not in ids:
                ids.append(int(token))
    return ids


def _sampling_defaults(generation_config: str, model_path: str) -> dict[str, Any]:
    """The sampling defaults --generation-config names (see ModelConfig.generation_config)."""
    if generation_config == "vllm":
        return {}
    if generation_config == "auto":
        found = read_generation_config(model_path)
    else:
        if not os.path.isfile(os.path.join(generation_config, "generation_config.json")):
            raise ValueError(
                f"--generation-config {generation_config!r}: expected auto, vllm or a directory that holds a "
                "generation_config.json"
            )
        found = read_generation_config(generation_config)
    return {field: found[key] for key, field in GENERATION_DEFAULTS.items() if found.get(key) is not None}


def _check_heads_divide(model: ModelConfig, parallel: ParallelConfig) -> None:
    num_heads = model.hf_config.get("num_attention_heads")
    tp = parallel.tensor_parallel_size
    if num_heads and num_heads % tp:
        raise ValueError(
            f"--tensor-parallel-size {tp} must divide the model's {num_heads} attention heads "
            f"(num_attention_heads={num_heads}, tensor_parallel_size={tp})"
        )


def _check_experts_divide(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Refuse an expert split before any process starts (the layers check again)."""
    ep = parallel.expert_parallel_size
    if model.is_moe and parallel.enable_expert_parallel and model.num_experts % ep:
        raise ValueError(
            f"--enable-expert-parallel: the model's {model.num_experts} experts must divide over the "
            f"expert-parallel size {ep} (--data-parallel-size {parallel.data_parallel_size} x "
            f"--tensor-parallel-size {parallel.tensor_parallel_size})"
        )


def _resolve_dtype(dtype: str, hf_config: dict[str, Any], device: DeviceConfig,
                   cpu_has_bf16: bool | None = None) -> str:
    """auto: the checkpoint's dtype, except on a CPU, which computes in
    bfloat16 only where it does so natively (AVX512-BF16/AMX) and in float32
    elsewhere: emulated bfloat16 is 3-8x slower there (issue 13). float16
    checkpoints run in bfloat16 on CPUs that have it. GGUF files count as
    bfloat16 (the dtype their quantized weights are multiplied in)."""
    dtype = {"float": "float32", "half": "float16"}.get(dtype, dtype)
    if dtype != "auto":
        if dtype == "float16" and device.device == "cpu":
            raise ValueError("--dtype float16 is not supported on the CPU; use bfloat16 or float32")
        return dtype
    stored = checkpoint_dtype(hf_config)
    if stored not in ("float32", "bfloat16", "float16"):
        return "float32"
    if device.device != "cpu" or stored == "float32":
        return stored
    if cpu_has_bf16 is None:
        cpu_has_bf16 = cpu_computes_bfloat16()
    return "bfloat16" if cpu_has_bf16 else "float32"


def _resolve_max_model_len(requested: int | None, hf_config: dict[str, Any], disable_sliding_window: bool) -> int:
    supported = next((int(hf_config[k]) for k in CONTEXT_LENGTH_KEYS if hf_config.get(k)), None)
    window = min((w for w in sliding_windows(hf_config) if w), default=None)
    if disable_sliding_window and window is not None and (supported is None or window < supported):
        if requested is not None and requested > window:
            raise ValueError(f"--max-model-len {requested} is longer than the model's sliding window ({window} tokens), "
                             "which --disable-sliding-window makes its context")
        supported = window  # within it, attending to every key is the same as the window
    if supported is None:
        if requested is None:
            raise ValueError("the model's config gives no context length: set --max-model-len")
        return requested
    if requested is None:
        return supported
    if not 0 < requested <= supported:
        raise ValueError(f"--max-model-len {requested} must be in [1, {supported}] (the model's context length)")
    return requested


def _resolve_scheduler(scheduler: SchedulerConfig, model: ModelConfig, device: DeviceConfig) -> SchedulerConfig:
    chunked = True if scheduler.enable_chunked_prefill is None else scheduler.enable_chunked_prefill
    max_model_len = model.max_model_len
    assert max_model_len is not None
    tokens = scheduler.max_num_batched_tokens
    if tokens is None:
        tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS[device.device]
        if not chunked:
            tokens = max(tokens, max_model_len)
    elif not chunked and tokens < max_model_len:
        raise ValueError(
            f"--max-num-batched-tokens {tokens} is smaller than --max-model-len {max_model_len}: "
            "a prompt would never fit in one step; raise it or turn on --enable-chunked-prefill"
        )
    seqs = DEFAULT_MAX_NUM_SEQS[device.device] if scheduler.max_num_seqs is None else scheduler.max_num_seqs
    if tokens < 1 or seqs < 1:
        raise ValueError(f"--max-num-batched-tokens ({tokens}) and --max-num-seqs ({seqs}) must be at least 1")
    return dataclasses.replace(
        scheduler, max_num_batched_tokens=tokens, max_num_seqs=seqs, enable_chunked_prefill=chunked
    )


def _resolve_load_format(load: LoadConfig, model: ModelConfig) -> LoadConfig:
    detected = "gguf" if model.is_gguf else "safetensors"
    if load.load_format == "auto":
        return dataclasses.replace(load, load_format=detected)
    if load.load_format != "dummy" and load.load_format != detected:
        raise ValueError(f"--load-format {load.load_format} does not fit --model {model.model_path} ({detected})")
    return load
