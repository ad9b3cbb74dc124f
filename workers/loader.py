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

import numpy as np
import torch
from torch import nn

from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import hf_config_from_gguf
from fleet.kernels.linear import keep_amx_weights, keep_bfloat16_decode_weights, prepack_prefill_weights
from fleet.kernels.quantized import GGUFWeight, keep_quantized, loaded_holding, pack_kept_weights
from fleet.workers.gguf_file import GGUFTensor, read_gguf_tensors
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
    "attn_q_norm": "self_attn.q_norm",  # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
}
GGUF_LAYER_NAMES_BY_TYPE = {
    "gemma3_text": {  # four norms a layer: ffn_norm is the one before the MLP
        **GGUF_LAYER_NAMES,
        "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm",
        "post_ffw_norm": "post_feedforward_layernorm",
    },
}
"""Where a model type's llama.cpp names differ from Llama's."""
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
        weights = iterate_weights(path, load_config.load_format)
        gguf_tensors = None
        if model_config.is_gguf:
            weights = gguf_tensors = list(weights)  # views of the file: cheap to hold
            if model_config.keeps_gguf_blocks(torch.device(device).type):
                keep_quantized(model, weights)
        if show_progress and sys.stderr.isatty():
            from tqdm import tqdm

            weights = tqdm(weights, desc="loading weights", unit=" tensors", leave=False)
        model.load_weights(weights)
        pack_kept_weights(model)
        if gguf_tensors is not None:
            model.gguf_holding = loaded_holding(model, gguf_tensors)
    device_type = torch.device(device).type
    if model_config.keeps_bfloat16_decode_weights(device_type):
        keep_bfloat16_decode_weights(model)
    if model_config.prepacks_prefill_weights(device_type):
        prepack_prefill_weights(model)
    if model_config.keeps_amx_gemm_copies(device_type):
        keep_amx_weights(model)
    return model.eval()


def _init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Norm weights 1, everything else small normal noise: runs like a real model."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            generator = torch.Generator(device=param.device).manual_seed(seed)
            param.data.normal_(0.0, 0.02, generator=generator)


def iterate_weights(model_path: str, load_format: str = "auto") -> Iterator[tuple[str, Any]]:
    """(HF name, weight) pairs of a checkpoint, read lazily by the layers'
    loaders: safetensors `get_slice` objects, or a GGUF file's tensors
    (`GGUFWeight`s for quantized ones, see kernels/quantized.py)."""
    if load_format == "auto":
        load_format = "gguf" if model_path.endswith(".gguf") else "safetensors"
    if load_format == "gguf":
        return gguf_weights(model_path)
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


def gguf_to_hf_name(gguf_name: str, model_type: str = "llama") -> str | None:
    """HF name of a llama.cpp tensor name, or None when there is no mapping."""
    base, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    if base in GGUF_GLOBAL_NAMES:
        return f"{GGUF_GLOBAL_NAMES[base]}.{kind}"
    layer_names = GGUF_LAYER_NAMES_BY_TYPE.get(model_type, GGUF_LAYER_NAMES)
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{kind}"
    return None


def gguf_weights(path: str) -> Iterator[tuple[str, torch.Tensor | GGUFWeight]]:
    """A GGUF file's tensors under HF names: float ones as tensors, quantized
    ones as their blocks (views of the file's mapping until a loader copies
    them). Q/K rows of llama models are put back in HF's order."""
    hf_config = hf_config_from_gguf(path)  # kept in fleet's cache
    num_heads = hf_config["num_attention_heads"]
    num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
    for tensor in read_gguf_tensors(path):
        hf_name = gguf_to_hf_name(tensor.name, hf_config["model_type"])
        if hf_name is None:
            if tensor.name.rpartition(".")[0] in GGUF_IGNORED:
                continue
            raise ValueError(f"GGUF tensor {tensor.name!r} of {path} has no HF counterpart")
        weight = _gguf_tensor(tensor)
        if hf_config["model_type"] == "llama":  # llama.cpp's converter permutes Q/K rows of llama models only
            if ".self_attn.q_proj." in hf_name:
                weight = _unpermuted(weight, num_heads)
            elif ".self_attn.k_proj." in hf_name:
                weight = _unpermuted(weight, num_kv_heads)
        yield hf_name, weight


_FLOAT_TYPES = {0: torch.float32, 1: torch.float16, 30: torch.bfloat16}
"""GGML types F32, F16, BF16 -> their torch dtype."""


def _gguf_tensor(tensor: GGUFTensor) -> torch.Tensor | GGUFWeight:
    """A float tensor, or the blocks of a quantized one."""
    data = torch.from_numpy(tensor.data)
    if tensor.gguf_type in _FLOAT_TYPES:
        return data.view(_FLOAT_TYPES[tensor.gguf_type]).reshape(tensor.shape)
    rows = int(np.prod(tensor.shape[:-1]))
    return GGUFWeight(tensor.gguf_type, data, (rows, tensor.shape[-1]))


def _unpermuted(weight: torch.Tensor | GGUFWeight, num_heads: int) -> torch.Tensor | GGUFWeight:
    if isinstance(weight, GGUFWeight):  # a row permutation moves whole rows of blocks
        return GGUFWeight(weight.gguf_type, unpermute_qk_rows(weight.data, num_heads), weight.shape)
    return unpermute_qk_rows(weight, num_heads)


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
