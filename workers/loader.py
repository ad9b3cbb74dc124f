"""Read checkpoint weights (an HF safetensors directory or a GGUF file) and
build a model with them.

Weights travel as (HF name, tensor or slice) pairs; each parameter's
weight_loader reads only the part its rank owns.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.kernels.linear import keep_bfloat16_decode_weights, prepack_prefill_weights
from fleet.workers.models.registry import get_model_class

# llama.cpp tensor names -> HF names (per layer: blk.N.<part> -> model.layers.N.<module>)
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors with no HF counterpart: llama.cpp's precomputed llama3 rope factors
# (we compute them from the config, as transformers does).
GGUF_IGNORED = {"rope_freqs"}


def load_model(model_config: ModelConfig, load_config: LoadConfig, dtype: torch.dtype,
               device: torch.device | str, show_progress: bool = False) -> nn.Module:
    """Build the model class of the config's architecture and fill its weights
    (random ones for load_format "dummy"); `show_progress`: a progress bar on
    a terminal (one worker of the node shows it)."""
    architecture = model_config.architecture or model_config.hf_config["architectures"][0]
    model = get_model_class(architecture)(model_config.hf_config, dtype, device)
    if load_config.load_format == "dummy":
        _init_dummy_weights(model)
    else:
        path = model_config.model_path or model_config.model
        weights = iterate_weights(path, load_config.load_format, dtype)
        if show_progress and sys.stderr.isatty():
            from tqdm import tqdm

            weights = tqdm(weights, desc="loading weights", unit=" tensors", leave=False)
        model.load_weights(weights)
    device_type = torch.device(device).type
    if model_config.keeps_bfloat16_decode_weights(device_type):
        keep_bfloat16_decode_weights(model)
    if model_config.prepacks_prefill_weights(device_type):
        prepack_prefill_weights(model)
    return model.eval()


def _init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, everything else small normal noise: runs like a real model."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            generator = torch.Generator(device=param.device).manual_seed(seed)
            param.data.normal_(0.0, 0.02, generator=generator)


def iterate_weights(model_path: str, load_format: str = "auto",
                    dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, Any]]:
    """(HF name, weight) pairs of a checkpoint.

    safetensors: weights are `safe_open(...).get_slice(name)` objects, read
    lazily by the layers' loaders. GGUF: the same, from the file's weights
    dequantised into `dtype` once and kept in fleet's cache (see
    `dequantized_gguf`).
    """
    if load_format == "auto":
        load_format = "gguf" if model_path.endswith(".gguf") else "safetensors"
    if load_format == "gguf":
        return _safetensors_file_weights(dequantized_gguf(model_path, dtype))
    if load_format == "safetensors":
        return _safetensors_weights(model_path)
    raise ValueError(f"--load-format {load_format!r} has no weights to read (expected auto, safetensors or gguf)")


def safetensors_files(directory: str) -> list[str]:
    """The checkpoint's files: those the index names when there is one (a repo
    may also hold e.g. a consolidated.safetensors with other names)."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    else:
        names = sorted(name for name in os.listdir(directory) if name.endswith(".safetensors"))
    if not names:
        raise ValueError(f"model directory {directory!r} holds no *.safetensors files")
    return [os.path.join(directory, name) for name in names]


def _safetensors_weights(directory: str) -> Iterator[tuple[str, Any]]:
    for file in safetensors_files(directory):
        yield from _safetensors_file_weights(file)


def _safetensors_file_weights(file: str) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as checkpoint:
        for name in checkpoint.keys():  # noqa: SIM118 (safe_open is not a dict)
            yield name, checkpoint.get_slice(name)


def dequantized_gguf(path: str, dtype: torch.dtype) -> str:
    """A safetensors file of the GGUF file's weights, dequantised into `dtype`
    under HF names, made on first use and kept in fleet's cache (keyed by the
    file's path, size and mtime). Parsing a GGUF file and dequantising it takes
    seconds (the default model: about 6 s); reading the kept file is a mmap."""
    from safetensors.torch import save

    from fleet.config.derived_cache import derived_path, write_atomically

    cached = derived_path(path, f"gguf-weights-{str(dtype).removeprefix('torch.')}") + ".safetensors"
    if not os.path.isfile(cached):  # workers of one launch may derive it at once: last rename wins
        write_atomically(cached, save({name: weight.to(dtype).contiguous() for name, weight in _gguf_weights(path)}))
    return cached


def gguf_to_hf_name(gguf_name: str) -> str | None:
    """HF name of a llama.cpp tensor name, or None when there is no mapping."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{kind}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_NAMES[parts[2]]}.{kind}"
    return None


def _gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf  # deferred: only GGUF models need it
    import numpy as np

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    num_heads = reader.fields[f"{arch}.attention.head_count"].contents()
    kv_field = reader.fields.get(f"{arch}.attention.head_count_kv")
    num_kv_heads = kv_field.contents() if kv_field is not None else num_heads
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            if tensor.name.rpartition(".")[0] in GGUF_IGNORED:
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} of {path} has no HF counterpart")
        # dequantize gives torch's (out, in) order: GGUF lists dims the other way round.
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(array if array.flags.writeable else np.array(array))
        if arch == "llama":  # llama.cpp's converter permutes Q/K rows of llama models only
            if ".self_attn.q_proj." in hf_name:
                weight = unpermute_qk_rows(weight, num_heads)
            elif ".self_attn.k_proj." in hf_name:
                weight = unpermute_qk_rows(weight, num_kv_heads)
        yield hf_name, weight


def unpermute_qk_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`).

    llama.cpp rotates adjacent pairs (GPT-J style), so its converter
    interleaves each head's two rotary halves; HF rotates halves (neox style).
    Per head, rows [x0, y0, x1, y1, ...] go back to [x0, x1, ..., y0, y1, ...],
    exactly as transformers' GGUF loader does.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return weight.reshape(num_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
