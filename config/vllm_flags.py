"""The flags of `vllm serve` (vLLM 0.32.0) that fleet has no flag of its own
for, so that a vLLM command line runs unchanged with `fleet launch`.

Each is one of:
- ignored: it tunes how vLLM does something that fleet does its own way, or a
  part fleet does not have, and what requests get is the same without it. It
  is accepted (with its value) and the launch logs one line saying why.
- refused: honouring it would change what requests get or which API is
  served (LoRA, draft-model speculative decoding, reasoning parsers, quantization
  methods, HTTPS, ...) and fleet cannot. The launch exits 2 naming the flag,
  its value and why. Values that ask for what fleet does anyway (`accepts`:
  `--kv-cache-dtype auto`), and the `--no-X` form of a refused switch, are
  accepted and ignored instead.

A reason is a fact about fleet, read after "ignored: " or "not supported: ".
Flags fleet implements under vLLM's name (or an alias in config/cli_args.py
ALIASES) are not listed; tests/config/test_vllm_flags.py keeps this table
equal to what vLLM has and fleet lacks."""
from __future__ import annotations

import argparse
from typing import Any, Literal, NamedTuple

Kind = Literal["switch", "value", "values"]
"""As vLLM's parser takes the flag: no value, one value, or one or more."""

IGNORED_DEST = "vllm_flags_ignored"
"""The namespace attribute that collects the ignored flags: a tuple of IgnoredFlag."""


class VllmFlag(NamedTuple):
    kind: Kind
    refused: bool
    reason: str
    accepts: tuple[str, ...] = ()
    """For a refused flag: the values that ask for what fleet does anyway (accepted, ignored)."""


class IgnoredFlag(NamedTuple):
    flag: str
    """The flag as given, with its value: `--max-log-len 100`."""
    reason: str


def ignore(kind: Kind, reason: str) -> VllmFlag:
    return VllmFlag(kind, False, reason)


def refuse(kind: Kind, reason: str, accepts: tuple[str, ...] = ()) -> VllmFlag:
    return VllmFlag(kind, True, reason, accepts)


NO_CUDA_GRAPHS = "fleet captures no CUDA graphs: it runs eagerly, compiling only what --compilation-config asks"
OWN_KERNELS = "fleet chooses its own kernels (its CPU kernels; Triton or torch on CUDA)"
NO_MAMBA = "fleet runs no Mamba, GDN or KDA layers"
TEXT_ONLY = "fleet serves text-only models: it has no multimodal encoder, processor or cache"
MULTIMODAL = "fleet serves text-only models: requests carry no images, audio or video"
LORA = "fleet serves no LoRA adapters"
NO_REQUEST_LOGS = "fleet logs no requests, outputs or per-step statistics (/metrics counts them)"
OWN_LOGGING = "fleet's processes log at INFO to stderr, one line per event"
METRICS = "fleet's /metrics serves its own fixed set of Prometheus metrics"
NO_TRACES = "fleet exports no OpenTelemetry traces"
ACCESS_LOG = "fleet's HTTP server writes no access log at its default --uvicorn-log-level warning"
HTTPS = "fleet serves plain HTTP (put a TLS-terminating proxy in front)"
HTTPS_DETAIL = "it only matters with --ssl-certfile, and fleet serves plain HTTP"
CORS = "fleet sends no CORS headers: browsers may not call it from another origin"
CORS_DETAIL = "it only matters with --allowed-origins, and fleet sends no CORS headers"
SPECULATIVE = "fleet takes speculative decoding as --speculative-config '{\"method\": \"ngram\", ...}'"
SPECULATIVE_METRICS = "fleet counts drafts and accepted tokens per engine in /metrics (fleet:spec_decode_*)"
REASONING = "fleet has no reasoning parser: a model's reasoning stays in the message content"
DISAGGREGATION = "fleet transfers KV (--kv-transfer-config), not encoder caches"
SLEEP = "fleet has no sleep mode (/sleep, /wake_up)"
WEIGHT_OFFLOAD = "fleet keeps all weights on the device, and refuses a launch whose weights do not fit"
KV_OFFLOAD = "fleet keeps the KV cache on the device"
COLLECTIVES = "fleet's collectives are torch.distributed's (NCCL on CUDA, gloo on the CPU), with no tuning knobs"
BATCH_OVERLAP = "fleet runs each step as one batch (no dual-batch overlap or micro-batches)"
EXPERTS = "fleet splits the experts evenly and contiguously over the expert-parallel ranks, without rebalancing"
REPLICA_SYNC = "fleet's data-parallel replicas step on their own, except a MoE model's under expert parallel"
SCHEDULER = "fleet's scheduler shares --max-num-batched-tokens, running requests first; --max-num-seqs bounds a step"
CONTEXT_PARALLEL = "fleet has no context parallelism (use --tensor-parallel-size)"
CACHE_TUNING = "fleet's KV cache has one block size (--block-size) and its own prefix-cache keys"
LOADING = "fleet memory-maps safetensors files (or reads a GGUF file) itself, with no loader options"
HUB_FILES = "fleet downloads only a model's config, tokenizer and safetensors files"
HUB_REVISION = "fleet downloads the hub's default revision (download another yourself and pass its directory)"
HUB_CODE = "fleet runs no model code from the hub: its architectures are its own"
HUB_TOKEN = "fleet reads the hub token from HF_TOKEN or the `hf auth login` cache (set HF_TOKEN to pass one)"
NO_PLUGINS = "fleet loads no Python code named on its command line"
NUMA = "fleet places its processes itself (on the CPU: its threads over the cores it is given)"
QUEUE = "fleet queues every request it accepts: no 503 at a queue limit"
MODEL_CONFIG = "fleet reads the model's own config.json (or GGUF metadata) unchanged"

VLLM_FLAGS: dict[str, VllmFlag] = {
    "--additional-config": ignore("value", "fleet has no platform plugins to pass settings to"),
    "--aggregate-engine-logging": ignore("switch", NO_REQUEST_LOGS),
    "--all2all-backend": ignore("value", COLLECTIVES),
    "--allow-credentials": ignore("switch", CORS_DETAIL),
    "--allow-deprecated-quantization": ignore("switch", "fleet has no deprecated quantization methods"),
    "--allowed-headers": ignore("value", CORS_DETAIL),
    "--allowed-local-media-path": refuse("value", MULTIMODAL, accepts=("",)),
    "--allowed-media-domains": ignore("values", "fleet fetches no media"),
    "--allowed-methods": ignore("value", CORS_DETAIL),
    "--allowed-origins": refuse("value", CORS, accepts=("[]",)),
    "--anthropic-disabled-thinking-effort": ignore("value", "fleet serves no Anthropic /v1/messages endpoint"),
    "--async-scheduling": ignore("switch", "fleet's engine core overlaps its own input and output work with the step"),
    "--attention-backend": ignore("value", OWN_KERNELS),
    "--attention-config": ignore("value", OWN_KERNELS),
    "--aux-output-config": refuse("value", "fleet returns no auxiliary outputs (routed experts)"),
    "--chat-template-content-format": refuse(
        "value", "fleet renders each message's content as one string", accepts=("auto", "string")),
    "--code-revision": ignore("value", HUB_CODE),
    "--cohere-format": ignore("value", "fleet has no Cohere tokenizer mode"),
    "--cohere-is-reasoning-model": ignore("switch", "fleet serves no Cohere /cohere/v2/chat endpoint"),
    "--collect-detailed-traces": ignore("values", NO_TRACES),
    "--config-format": refuse("value", MODEL_CONFIG, accepts=("auto", "hf")),
    "--convert": refuse("value", "fleet serves generation and /v1/embeddings (pooled by --pooling-type) from every "
                        "model, and no classification", accepts=("auto", "none", "embed")),
    "--cp-kv-cache-interleave-size": ignore("value", CONTEXT_PARALLEL),
    "--cpu-distributed-timeout-seconds": ignore("value", "fleet's --distributed-timeout-seconds bounds every group"),
    "--cpu-offload-gb": ignore("value", WEIGHT_OFFLOAD),
    "--cpu-offload-params": ignore("values", WEIGHT_OFFLOAD),
    "--cudagraph-capture-sizes": ignore("values", NO_CUDA_GRAPHS),
    "--cudagraph-metrics": ignore("switch", NO_CUDA_GRAPHS),
    "--custom-histogram-buckets": ignore("value", METRICS),
    "--data-parallel-multi-port-external-lb": refuse(
        "switch", "fleet's external load balancing is one launch per rank (--data-parallel-rank)"),
    "--data-parallel-supervisor-port": ignore("value", "it only matters with --data-parallel-multi-port-external-lb"),
    "--dbo-decode-token-threshold": ignore("value", BATCH_OVERLAP),
    "--dbo-prefill-token-threshold": ignore("value", BATCH_OVERLAP),
    "--dcp-comm-backend": ignore("value", CONTEXT_PARALLEL),
    "--dcp-kv-cache-interleave-size": ignore("value", CONTEXT_PARALLEL),
    "--dcp-q-replicate": ignore("switch", CONTEXT_PARALLEL),
    "--decode-context-parallel-size": refuse("value", CONTEXT_PARALLEL, accepts=("1",)),
    "--default-chat-template-kwargs": refuse(
        "value", "fleet has no server-wide chat template arguments (a request may send chat_template_kwargs)"),
    "--default-mm-loras": refuse("value", LORA),
    "--device-ids": refuse("value", "fleet uses the GPUs it sees: set CUDA_VISIBLE_DEVICES instead"),
    "--diffusion-config": refuse("value", "fleet serves no diffusion language models"),
    "--disable-access-log-for-endpoints": ignore("value", ACCESS_LOG),
    "--disable-cascade-attn": ignore("switch", "fleet has no cascade attention (nor has vLLM any more)"),
    "--disable-chunked-mm-input": ignore("switch", TEXT_ONLY),
    "--disable-custom-all-reduce": ignore("switch", COLLECTIVES),
    "--disable-hybrid-kv-cache-manager": ignore("switch", "fleet's models have one kind of attention layer"),
    "--disable-log-stats": ignore("switch", NO_REQUEST_LOGS),
    "--disable-nccl-for-dp-synchronization": ignore("switch", REPLICA_SYNC),
    "--disable-uvicorn-access-log": ignore("switch", ACCESS_LOG),
    "--dp-supervisor-probe-failure-threshold": ignore("value", "it only matters with "
                                                      "--data-parallel-multi-port-external-lb"),
    "--dp-supervisor-probe-interval-s": ignore("value", "it only matters with --data-parallel-multi-port-external-lb"),
    "--dp-supervisor-probe-timeout-s": ignore("value", "it only matters with --data-parallel-multi-port-external-lb"),
    "--dp-sync-interval": ignore("value", REPLICA_SYNC),
    "--ec-manager-config": ignore("value", TEXT_ONLY),
    "--ec-transfer-config": refuse("value", DISAGGREGATION),
    "--elastic-ep-max-dp-size": ignore("value", "it only matters with --enable-elastic-ep"),
    "--enable-batch-sharded-sampling": ignore("switch", "fleet samples on each replica's first worker"),
    "--enable-cumem-allocator": ignore("switch", "fleet uses PyTorch's own allocator"),
    "--enable-dbo": ignore("switch", BATCH_OVERLAP),
    "--enable-elastic-ep": refuse("switch", "fleet's expert-parallel size is fixed at launch"),
    "--enable-ep-weight-filter": ignore("switch", EXPERTS),
    "--enable-eplb": ignore("switch", EXPERTS),
    "--enable-fault-tolerance": ignore("switch", "fleet restarts a dead replica as --replica-restart-policy says"),
    "--enable-flash-late-interaction": ignore("switch", "fleet serves no late-interaction (MaxSim) scoring"),
    "--enable-flashinfer-autotune": ignore("switch", OWN_KERNELS),
    "--enable-force-include-usage": refuse("switch", "fleet includes usage as each request asks (stream_options)"),
    "--enable-hc-sp": ignore("switch", "fleet's models have no HyperConnection layers"),
    "--enable-layerwise-nvtx-tracing": ignore("switch", "fleet adds no NVTX ranges"),
    "--enable-log-deltas": ignore("switch", NO_REQUEST_LOGS),
    "--enable-log-outputs": ignore("switch", NO_REQUEST_LOGS),
    "--enable-log-requests": ignore("switch", NO_REQUEST_LOGS),
    "--enable-logging-iteration-details": ignore("switch", NO_REQUEST_LOGS),
    "--enable-lora": refuse("switch", LORA),
    "--enable-mamba-cache-stochastic-rounding": ignore("switch", NO_MAMBA),
    "--enable-mamba-shared-prefix-checkpoint": ignore("switch", NO_MAMBA),
    "--enable-mfu-metrics": ignore("switch", METRICS),
    "--enable-mixed-moe-lora-format": refuse("switch", LORA),
    "--enable-mm-embeds": refuse("switch", MULTIMODAL),
    "--enable-moe-shared-loras": refuse("switch", LORA),
    "--enable-nccl-comm-suspend": ignore("switch", SLEEP),
    "--enable-offline-docs": ignore("switch", "fleet's /docs page loads its scripts from FastAPI's default CDN"),
    "--enable-per-request-metrics": refuse("switch", "fleet's responses carry no per-request timing metrics"),
    "--enable-prompt-embeds": refuse("switch", "fleet takes prompts as text or token ids, not embeddings"),
    "--enable-prompt-tokens-details": refuse("switch", "fleet's usage has no prompt_tokens_details"),
    "--enable-request-id-headers": refuse("switch", "fleet's responses carry no X-Request-Id header"),
    "--enable-return-routed-experts": refuse("switch", "fleet returns no auxiliary outputs (routed experts)"),
    "--enable-scale-out": refuse("switch", "fleet serves no /render, /derender or /inference/v1 endpoints"),
    "--enable-server-load-tracking": ignore("switch", "fleet's /load reports the server load already"),
    "--enable-shm-tensor-arena": ignore("switch", TEXT_ONLY),
    "--enable-sleep-mode": refuse("switch", SLEEP),
    "--enable-ssl-refresh": ignore("switch", HTTPS_DETAIL),
    "--enable-tokenizer-info-endpoint": refuse("switch", "fleet serves no /tokenizer_info endpoint"),
    "--enable-tower-connector-lora": refuse("switch", LORA),
    "--enable-trace-replay": refuse("switch", "fleet's requests cannot replay a given token sequence"),
    "--enforce-eager": ignore("switch", NO_CUDA_GRAPHS),
    "--engram-config": ignore("value", "fleet's models have no Engram n-gram tables"),
    "--eplb-config": ignore("value", EXPERTS),
    "--exclude-tools-when-tool-choice-none": refuse(
        "switch", "fleet renders a request's tools into the prompt whatever its tool_choice"),
    "--expert-placement-strategy": ignore("value", EXPERTS),
    "--fail-on-environ-validation": ignore("switch", "fleet reads a few FLEET_* variables and checks them itself"),
    "--fault-tolerance-config": ignore("value", "fleet restarts a dead replica as --replica-restart-policy says"),
    "--fingerprint-mode": refuse("value", "fleet's responses carry no system_fingerprint", accepts=("none",)),
    "--fingerprint-value": ignore("value", "fleet's responses carry no system_fingerprint"),
    "--fully-sharded-loras": refuse("switch", LORA),
    "--gdn-prefill-backend": ignore("value", NO_MAMBA),
    "--grpc": refuse("switch", "fleet serves HTTP only, no gRPC"),
    "--grpc-port": refuse("value", "fleet serves HTTP only, no gRPC"),
    "--h11-max-header-count": ignore("value", "fleet keeps the HTTP server's own header limits"),
    "--h11-max-incomplete-event-size": ignore("value", "fleet keeps the HTTP server's own header limits; "
                                              "--max-request-body-bytes bounds bodies"),
    "--hf-config-path": refuse("value", MODEL_CONFIG),
    "--hf-overrides": refuse("value", MODEL_CONFIG),
    "--hf-token": refuse("value", HUB_TOKEN, accepts=("True",)),
    "--ignore-patterns": ignore("values", HUB_FILES),
    "--interleave-mm-strings": ignore("switch", TEXT_ONLY),
    "--io-processor-plugin": refuse("value", NO_PLUGINS),
    "--ir-op-priority": ignore("value", OWN_KERNELS),
    "--jit-monitor-mode": ignore("value", "fleet does not watch for JIT compilation after warm-up"),
    "--jit-monitor-verbose": ignore("switch", "fleet does not watch for JIT compilation after warm-up"),
    "--kda-decode-backend": ignore("value", NO_MAMBA),
    "--kda-prefill-backend": ignore("value", NO_MAMBA),
    "--kernel-config": ignore("value", OWN_KERNELS),
    "--kv-cache-dtype": refuse("value", "fleet's KV cache has the model's dtype", accepts=("auto",)),
    "--kv-cache-dtype-skip-layers": ignore("values", "fleet's KV cache has the model's dtype"),
    "--kv-cache-metrics": ignore("switch", METRICS),
    "--kv-cache-metrics-sample": ignore("value", METRICS),
    "--kv-events-config": refuse("value", "fleet publishes no KV cache events"),
    "--kv-offloading-backend": ignore("value", KV_OFFLOAD),
    "--kv-offloading-size": ignore("value", KV_OFFLOAD),
    "--kv-sharing-fast-prefill": ignore("switch", "fleet's models share no KV cache between layers"),
    "--language-model-only": ignore("switch", TEXT_ONLY),
    "--limit-mm-per-prompt": refuse("value", MULTIMODAL),
    "--linear-backend": ignore("value", OWN_KERNELS),
    "--log-config-file": ignore("value", OWN_LOGGING),
    "--log-error-stack": ignore("switch", "fleet logs the stack of unexpected errors (500s) only"),
    "--log-level": ignore("value", OWN_LOGGING),
    "--logging-config": ignore("value", OWN_LOGGING),
    "--logits-processors": refuse("values", NO_PLUGINS),
    "--logprobs-mode": refuse("value", "fleet returns the model's raw logprobs", accepts=("raw_logprobs",)),
    "--long-prefill-token-threshold": ignore("value", SCHEDULER),
    "--long-prefill-token-threshold-adaptive": ignore("switch", SCHEDULER),
    "--lora-dtype": refuse("value", LORA),
    "--lora-modules": refuse("values", LORA),
    "--lora-target-modules": refuse("values", LORA),
    "--mamba-backend": ignore("value", NO_MAMBA),
    "--mamba-block-size": ignore("value", NO_MAMBA),
    "--mamba-cache-dtype": ignore("value", NO_MAMBA),
    "--mamba-cache-mode": ignore("value", NO_MAMBA),
    "--mamba-cache-philox-rounds": ignore("value", NO_MAMBA),
    "--mamba-ssm-cache-dtype": ignore("value", NO_MAMBA),
    "--mamba-ssu-algorithm": ignore("value", NO_MAMBA),
    "--max-cpu-loras": refuse("value", LORA),
    "--max-cudagraph-capture-size": ignore("value", NO_CUDA_GRAPHS),
    "--max-log-len": ignore("value", NO_REQUEST_LOGS),
    "--max-lora-cls-labels": refuse("value", LORA),
    "--max-lora-rank": refuse("value", LORA),
    "--max-loras": refuse("value", LORA),
    "--max-num-active-seqs": ignore("value", SCHEDULER),
    "--max-num-queued-reqs": refuse("value", QUEUE),
    "--max-num-queued-tokens": refuse("value", QUEUE),
    "--max-num-scheduled-tokens": ignore("value", SCHEDULER),
    "--max-parallel-loading-workers": ignore("value", LOADING),
    "--media-io-kwargs": ignore("value", TEXT_ONLY),
    "--middleware": refuse("value", NO_PLUGINS),
    "--mm-device-do-normalize": ignore("switch", TEXT_ONLY),
    "--mm-encoder-attn-backend": ignore("value", TEXT_ONLY),
    "--mm-encoder-attn-dtype": ignore("value", TEXT_ONLY),
    "--mm-encoder-fp8-scale-path": ignore("value", TEXT_ONLY),
    "--mm-encoder-fp8-scale-save-margin": ignore("value", TEXT_ONLY),
    "--mm-encoder-fp8-scale-save-path": ignore("value", TEXT_ONLY),
    "--mm-encoder-only": refuse("switch", "fleet serves whole language models, not a multimodal encoder alone"),
    "--mm-encoder-tp-mode": ignore("value", TEXT_ONLY),
    "--mm-hasher-algorithm": ignore("value", TEXT_ONLY),
    "--mm-ipc-gpu-memory-gb": ignore("value", TEXT_ONLY),
    "--mm-processor-cache-gb": ignore("value", TEXT_ONLY),
    "--mm-processor-cache-type": ignore("value", TEXT_ONLY),
    "--mm-processor-device": ignore("value", TEXT_ONLY),
    "--mm-processor-kwargs": ignore("value", TEXT_ONLY),
    "--mm-shm-cache-max-object-size-mb": ignore("value", TEXT_ONLY),
    "--mm-tensor-ipc": ignore("value", TEXT_ONLY),
    "--model-class-overrides": refuse("value", "fleet's architectures are its own (workers/models/registry.py)"),
    "--model-impl": refuse("value", "fleet runs its own implementation of each architecture", accepts=("auto", "vllm")),
    "--model-loader-extra-config": ignore("value", LOADING),
    "--moe-backend": ignore("value", OWN_KERNELS),
    "--num-gpu-blocks-override": ignore("value", "fleet sizes its KV cache from --kv-cache-memory-bytes or "
                                        "--gpu-memory-utilization"),
    "--numa-bind": ignore("switch", NUMA),
    "--numa-bind-cpus": ignore("values", NUMA),
    "--numa-bind-nodes": ignore("values", NUMA),
    "--offload-backend": ignore("value", WEIGHT_OFFLOAD),
    "--offload-group-size": ignore("value", WEIGHT_OFFLOAD),
    "--offload-num-in-group": ignore("value", WEIGHT_OFFLOAD),
    "--offload-params": ignore("values", WEIGHT_OFFLOAD),
    "--offload-prefetch-step": ignore("value", WEIGHT_OFFLOAD),
    "--optimization-level": ignore("value", NO_CUDA_GRAPHS),
    "--otlp-traces-endpoint": refuse("value", NO_TRACES),
    "--override-generation-config": refuse(
        "value", "fleet takes sampling defaults from --generation-config only, without overrides"),
    "--per-request-spec-decode-metrics": ignore("value", SPECULATIVE_METRICS),
    "--performance-mode": ignore("value", "fleet has one mode: --max-num-seqs and --max-num-batched-tokens tune it"),
    "--pooler-config": refuse("value", "fleet pools embeddings as --pooling-type says, L2-normalised"),
    "--prefill-context-parallel-size": refuse("value", CONTEXT_PARALLEL, accepts=("1",)),
    "--prefill-schedule-interval": ignore("value", REPLICA_SYNC),
    "--prefix-cache-retention-interval": ignore("value", CACHE_TUNING),
    "--prefix-caching-hash-algo": ignore("value", CACHE_TUNING),
    "--prefix-match-unit": ignore("value", CACHE_TUNING),
    "--profiler-config": refuse("value", "fleet has no profiler endpoints (/start_profile)"),
    "--pt-load-map-location": ignore("value", "fleet reads no PyTorch .bin checkpoints"),
    "--quantization": refuse("value", "fleet reads GGUF files' quantized blocks and safetensors float32, bfloat16 "
                             "or float16 weights, and has no other quantization method", accepts=("gguf",)),
    "--quantization-config": refuse("value", "fleet reads GGUF files' quantized blocks and safetensors float "
                                    "weights, and has no other quantization method"),
    "--ray-workers-use-nsight": ignore("switch", "fleet starts no profiler under Ray"),
    "--reasoning-config": refuse("value", REASONING),
    "--reasoning-parser": refuse("value", REASONING),
    "--reasoning-parser-plugin": refuse("value", REASONING),
    "--renderer-num-workers": ignore("value", "fleet renders chat templates in --sandbox-processes processes"),
    "--replayssm-buffer-len": ignore("value", NO_MAMBA),
    "--response-role": refuse("value", "fleet's chat responses have the role assistant", accepts=("assistant",)),
    "--return-sampling-mask": refuse("switch", "fleet's responses carry no sampling masks"),
    "--return-tokens-as-token-ids": refuse("switch", "fleet's logprobs name tokens by their text"),
    "--revision": refuse("value", HUB_REVISION, accepts=("main",)),
    "--runner": refuse("value", "fleet runs every model for generation and /v1/embeddings; it has no draft runner",
                       accepts=("auto", "generate", "pooling")),
    "--safetensors-load-strategy": ignore("value", LOADING),
    "--safetensors-prefetch-block-size": ignore("value", LOADING),
    "--safetensors-prefetch-num-threads": ignore("value", LOADING),
    "--scheduler-cls": refuse("value", NO_PLUGINS, accepts=("vllm.v1.core.sched.scheduler.Scheduler",)),
    "--scheduler-reserve-full-isl": ignore("switch", SCHEDULER),
    "--show-hidden-metrics-for-version": ignore("value", METRICS),
    "--skip-mm-profiling": ignore("switch", TEXT_ONLY),
    "--skip-tokenizer-init": refuse("switch", "fleet always loads the tokenizer: its API takes and returns text"),
    "--sleep-mode-offload-cudagraph": ignore("switch", SLEEP),
    "--sleep-preserve-parameter-names": ignore("values", SLEEP),
    "--sparse-indexer-topk-backend": ignore("value", OWN_KERNELS),
    "--spec-method": refuse("value", SPECULATIVE),
    "--spec-model": refuse("value", SPECULATIVE),
    "--spec-tokens": refuse("value", SPECULATIVE),
    "--specialize-active-lora": refuse("switch", LORA),
    "--sse-keep-alive-interval": refuse("value", "fleet sends no SSE keep-alive comments", accepts=("0",)),
    "--ssl-ca-certs": ignore("value", HTTPS_DETAIL),
    "--ssl-cert-reqs": ignore("value", HTTPS_DETAIL),
    "--ssl-certfile": refuse("value", HTTPS),
    "--ssl-ciphers": ignore("value", HTTPS_DETAIL),
    "--ssl-keyfile": refuse("value", HTTPS),
    "--stream-interval": ignore("value", "fleet streams each step's tokens as they come"),
    "--structured-outputs-config": refuse("value", "fleet's structured outputs use llguidance with fixed settings"),
    "--swa-bounded-replay": ignore("switch", "fleet's prefix cache keeps every block of a sequence, those of sliding-window layers too"),
    "--tokenizer-mode": refuse("value", "fleet uses the model's Hugging Face tokenizer (or the GGUF file's)",
                               accepts=("auto", "hf")),
    "--tokenizer-revision": refuse("value", HUB_REVISION, accepts=("main",)),
    "--tokens-only": refuse("switch", "fleet serves the OpenAI API, not a tokens-only endpoint"),
    "--tool-parser-plugin": refuse("value", NO_PLUGINS),
    "--tool-server": refuse("value", "fleet runs no built-in tools or tool servers"),
    "--tool-strict-level": refuse("value", "fleet constrains no tool calls beyond what a request asks",
                                  accepts=("auto",)),
    "--trust-remote-code": ignore("switch", HUB_CODE),
    "--trust-request-mm-kwargs": refuse("switch", MULTIMODAL),
    "--ubatch-size": ignore("value", BATCH_OVERLAP),
    "--uds": refuse("value", "fleet listens on --host and --port, not a Unix socket"),
    "--use-fp64-gumbel": ignore("switch", "fleet's sampler draws in float32"),
    "--use-replayssm": ignore("switch", NO_MAMBA),
    "--use-tqdm-on-load": ignore("switch", "fleet logs one line when the weights are loaded"),
    "--video-pruning-method": ignore("value", TEXT_ONLY),
    "--video-pruning-rate": ignore("value", TEXT_ONLY),
    "--watermark": ignore("value", SCHEDULER),
    "--watermark-config": refuse("value", "fleet adds no watermark to generated text"),
    "--weight-transfer-config": refuse("value", "fleet's weights are fixed at load (no weight updates)"),
    "--worker-cls": refuse("value", NO_PLUGINS, accepts=("auto",)),
    "--worker-extension-cls": refuse("value", NO_PLUGINS, accepts=("",)),
}
"""Every `vllm serve` flag of vLLM 0.32.0 that fleet's own parser lacks."""

OLDER_VLLM_FLAGS: dict[str, VllmFlag] = {
    "--disable-log-requests": ignore("switch", NO_REQUEST_LOGS),
    "--max-seq-len-to-capture": ignore("value", NO_CUDA_GRAPHS),
    "--swap-space": ignore("value", "fleet preempts a request by recomputing it later, not by swapping to the CPU"),
}
"""Flags that vLLM versions before 0.32 took and command lines still carry."""

SHORT_FLAGS: dict[str, str] = {
    "-O": "--optimization-level",
    "-ac": "--attention-config",
    "-dc": "--diffusion-config",
    "-dcp": "--decode-context-parallel-size",
    "-dpm": "--data-parallel-multi-port-external-lb",
    "-pcp": "--prefill-context-parallel-size",
    "-q": "--quantization",
}
"""vLLM's short forms of flags in VLLM_FLAGS (-O3, -O 3 and -O=3 all parse)."""

OPTIONAL_VALUE: dict[str, str] = {"--hf-token": "True"}
"""Flags whose value vLLM lets the user leave out, and what the bare flag means."""


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """Add the flags of VLLM_FLAGS and OLDER_VLLM_FLAGS that `parser` lacks,
    hidden from --help. An ignored flag adds an IgnoredFlag to the
    namespace's IGNORED_DEST; a refused one is a usage error (exit 2)."""
    parser.set_defaults(**{IGNORED_DEST: ()})
    shorts: dict[str, list[str]] = {}
    for short, long in SHORT_FLAGS.items():
        shorts.setdefault(long, []).append(short)
    taken = set(parser._option_string_actions)
    for flag, entry in {**VLLM_FLAGS, **OLDER_VLLM_FLAGS}.items():
        if flag in taken:
            continue  # fleet's own flag of that name wins
        options = [option for option in [flag, *shorts.get(flag, [])] if option not in taken]
        kwargs: dict[str, Any] = {"nargs": {"switch": 0, "value": None, "values": "+"}[entry.kind]}
        if flag in OPTIONAL_VALUE:
            kwargs.update(nargs="?", const=OPTIONAL_VALUE[flag])
        parser.add_argument(*options, action=VllmFlagAction, entry=entry, dest=argparse.SUPPRESS,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)
        negative = "--no-" + flag[2:]
        if entry.kind == "switch" and negative not in taken:
            parser.add_argument(negative, action=VllmFlagAction, entry=entry._replace(refused=False), nargs=0,
                                dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


class VllmFlagAction(argparse.Action):
    """Record an ignored flag in the namespace; refuse a refused one."""

    def __init__(self, option_strings: list[str], dest: str, entry: VllmFlag, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.entry = entry

    def __call__(self, parser, namespace, values, option_string=None):
        value = None if values == [] else " ".join(values) if isinstance(values, list) else values
        given = option_string if value is None else f"{option_string} {value or repr(value)}"
        if self.entry.refused and value not in self.entry.accepts:
            parser.error(f"{given}: not supported: {self.entry.reason}")
        ignored = IgnoredFlag(given, self.entry.reason)
        recorded = getattr(namespace, IGNORED_DEST, ())
        if ignored not in recorded:
            setattr(namespace, IGNORED_DEST, (*recorded, ignored))


def check_vllm_keywords(keywords: dict[str, Any]) -> list[IgnoredFlag]:
    """vLLM's `LLM(...)` keyword arguments that fleet has no field for
    (`enforce_eager=True`), by the same table: the ignored ones, to be
    logged; raises ValueError for a refused one, TypeError for one vLLM does not take either."""
    ignored = []
    for name, value in keywords.items():
        flag = "--" + name.replace("_", "-")
        entry = VLLM_FLAGS.get(flag) or OLDER_VLLM_FLAGS.get(flag)
        if entry is None:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        unset = value is None or value is False
        if entry.refused and not unset and str(value) not in entry.accepts:
            raise ValueError(f"{name}={value!r}: not supported: {entry.reason}")
        if not unset:
            ignored.append(IgnoredFlag(f"{name}={value!r}", entry.reason))
    return ignored
