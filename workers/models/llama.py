"""Llama: Llama 2/3, SmolLM2, Mistral (and, with biases, Qwen2: see qwen2.py).

Model code is math: every parallel concern lives in fleet.parallel.layers.
A batch is the flattened new tokens of every sequence, no padding; the paged
KV cache and the batch layout come in through AttentionMetadata.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fleet.config.model import sliding_windows
from fleet.kernels.activation import silu_and_mul
from fleet.kernels.attention import AttentionMetadata, paged_attention, rotate_and_cache
from fleet.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from fleet.kernels.rotary import RotaryEmbedding
from fleet.parallel.comm import get_pp_group
from fleet.parallel.groups import stage_layers
from fleet.parallel.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    default_weight_loader,
)

# HF checkpoint name part -> (our fused parameter's name part, shard id)
STACKED_PARAMS = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


@dataclass(frozen=True)
class LlamaSpec:
    """The facts of an HF config this family's modules need."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    """An RMSNorm over each query and key head before the rotary embedding (Qwen3)."""
    sliding_windows: tuple[int, ...]
    """Per layer: how many keys back its attention reaches (a sliding window), 0 for all of them."""
    hf_config: dict[str, Any]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual)"""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class LlamaAttention(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str, window: int = 0) -> None:
        super().__init__()
        self.window = window
        self.qkv_proj = QKVParallelLinear(spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
                                          bias=spec.qkv_bias, dtype=dtype, device=device)
        self.o_proj = RowParallelLinear(spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias,
                                        dtype=dtype, device=device)
        self.num_heads = self.qkv_proj.num_heads_per_rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads_per_rank
        self.head_dim = spec.head_dim
        self.scale = spec.head_dim**-0.5
        if spec.qk_norm:  # one weight per head dimension, the same on every rank
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, rotary: RotaryEmbedding,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv_proj(hidden)
        if hasattr(self, "q_norm"):
            qkv = self._norm_heads(qkv, q_size, kv_size)
        q = None if rotary.partial else rotate_and_cache(qkv, positions, rotary.cos_sin_cache, kv_cache,
                                                         meta.slot_mapping, self.num_heads, self.num_kv_heads)
        k = v = None  # fused on the CPU: rotated, and the keys and values are in the cache
        if q is None:
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
            v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
            q, k = rotary(positions, q, k)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, self.window)  # [T, H, D]
        return self.o_proj(out.view(num_tokens, q_size))  # [T, hidden]

    def _norm_heads(self, qkv: torch.Tensor, q_size: int, kv_size: int) -> torch.Tensor:
        """qkv [T, q + 2 kv] with each query and key head RMS-normalised (the values as they are)."""
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, q_size)  # per head: [T * H, D]
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, kv_size)
        return torch.cat([q, k, v], dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(spec.hidden_size, [size, size], bias=spec.mlp_bias,
                                                       dtype=dtype, device=device)
        self.down_proj = RowParallelLinear(size, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))  # [T, 2I / tp] -> [T, I / tp] -> [T, hidden]


MlpFactory = Callable[[int], nn.Module]
"""Global layer index -> that layer's MLP (a MoE block in MoE models)."""


class LlamaDecoderLayer(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str,
                 mlp: nn.Module | None = None, window: int = 0) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(spec, dtype, device, window)
        self.mlp = mlp if mlp is not None else LlamaMLP(spec, dtype, device)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                rotary: RotaryEmbedding, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, the residual stream before it): the
        next layer adds the two, fused with its norm."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(positions, hidden, rotary, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack, or this pipeline stage's part of it: the first stage
    embeds, the last one normalises; layers keep their global index."""

    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str,
                 make_mlp: MlpFactory | None = None) -> None:
        super().__init__()
        take_stage(self, spec, dtype, device)
        self.layers = nn.ModuleDict({
            str(i): LlamaDecoderLayer(spec, dtype, device, make_mlp(i) if make_mlp else None, spec.sliding_windows[i])
            for i in self.layer_indices
        })
        if self.is_last_stage:
            self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, device)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_positions, spec.hf_config, dtype, device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """First stage: from input_ids; later stages: from `intermediate`
        ([2, T, hidden]: hidden and residual of the previous stage). Returns
        the normalised hidden [T, hidden] on the last stage, else the
        intermediate [2, T, hidden] for the next one."""
        if self.is_first_stage:
            hidden, residual = self.embed_tokens(input_ids), None  # [T, hidden]
        else:
            hidden, residual = intermediate[0], intermediate[1]
        for layer, kv_cache in zip(self.layers.values(), kv_caches, strict=True):
            hidden, residual = layer(positions, hidden, residual, self.rotary, kv_cache, meta)
        if not self.is_last_stage:
            return torch.stack((hidden, residual))
        hidden, _ = self.norm.add_and_norm(hidden, residual)
        return hidden


def take_stage(model: nn.Module, spec: LlamaSpec, dtype: torch.dtype, device: torch.device | str) -> None:
    """Set `model`'s pipeline stage facts (is_first_stage, is_last_stage, the
    global layer_indices it runs) and its embeddings where the stage needs them."""
    stage = get_pp_group()
    if stage.size > spec.num_layers:
        raise ValueError(f"--pipeline-parallel-size {stage.size} exceeds the model's {spec.num_layers} layers")
    model.is_first_stage, model.is_last_stage = stage.is_first, stage.is_last
    model.layer_indices = stage_layers(spec.num_layers, stage.size, stage.rank)
    if model.is_first_stage or (model.is_last_stage and spec.tie_word_embeddings):
        model.embed_tokens = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, dtype=dtype, device=device)


class LlamaForCausalLM(nn.Module):
    """Interface the model runner uses (shared by every model class):
    `num_layers`, `num_kv_heads` (per TP rank), `head_dim`; `forward`,
    `compute_logits`, `load_weights`. Subclasses change the MLP of a layer
    with `build_mlp` and checkpoint names with `param_name`."""

    def __init__(self, hf_config: dict[str, Any], dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.spec = self.spec_from_config(hf_config)
        self.model = LlamaModel(self.spec, dtype, device, lambda layer: self.build_mlp(layer, dtype, device))
        self._init_head_and_facts(dtype, device)

    def _init_head_and_facts(self, dtype: torch.dtype, device: torch.device | str) -> None:
        """The LM head (last stage) and the facts the runner reads, once self.model is built."""
        if self.model.is_last_stage:
            self.lm_head = ParallelLMHead(self.spec.vocab_size, self.spec.hidden_size, dtype=dtype, device=device)
            if self.spec.tie_word_embeddings:
                self.lm_head.tie_to(self.model.embed_tokens)
        attention = next(iter(self.model.layers.values())).self_attn
        self.num_layers = len(self.model.layers)  # of this pipeline stage
        self.num_kv_heads = attention.num_kv_heads
        self.head_dim = attention.head_dim

    @classmethod
    def spec_from_config(cls, hf_config: dict[str, Any]) -> LlamaSpec:
        num_heads = hf_config["num_attention_heads"]
        attention_bias = bool(hf_config.get("attention_bias", False))
        return LlamaSpec(
            hidden_size=hf_config["hidden_size"],
            intermediate_size=hf_config["intermediate_size"],
            num_layers=hf_config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf_config.get("num_key_value_heads") or num_heads,
            head_dim=hf_config.get("head_dim") or hf_config["hidden_size"] // num_heads,
            vocab_size=hf_config["vocab_size"],
            rms_norm_eps=hf_config.get("rms_norm_eps", 1e-6),
            max_positions=hf_config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,  # Llama's attention_bias covers o_proj too
            o_bias=attention_bias,
            mlp_bias=bool(hf_config.get("mlp_bias", False)),
            qk_norm=False,
            sliding_windows=sliding_windows(hf_config),
            hf_config=hf_config,
        )

    def build_mlp(self, layer: int, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """The MLP of global layer `layer`."""
        return LlamaMLP(self.spec, dtype, device)

    def param_name(self, hf_name: str) -> tuple[str, Any]:
        """Our parameter name and the shard id its weight_loader takes for an HF checkpoint name."""
        return _param_name(hf_name)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_meta: AttentionMetadata, intermediate: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: int64 [T] -> hidden [T, hidden] (last pipeline
        stage) or the intermediate [2, T, hidden] for the next stage."""
        return self.model(input_ids, positions, kv_caches, attn_meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """hidden [N, hidden] -> float32 logits [N, vocab] on tensor rank 0,
        None on the other ranks (a collective over the TP group)."""
        logits = self.lm_head.compute_logits(hidden)
        return None if logits is None else logits.float()

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> None:
        """Load HF-named weights (tensors or safetensors slices); every
        parameter must be covered, and every weight must have a place."""
        params = dict(self.named_parameters())  # a tied lm_head appears once, as embed_tokens
        loaded: set[str] = set()
        for hf_name, weight in weights:
            if "rotary_emb.inv_freq" in hf_name or (self.spec.tie_word_embeddings and hf_name == "lm_head.weight"):
                continue
            name, shard_id = self.param_name(hf_name)
            if name not in params and not _stage_owns(self.model, name):
                continue  # another pipeline stage's weight
            if name not in params:
                raise ValueError(f"checkpoint weight {hf_name!r} has no parameter in {type(self).__name__}")
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, weight, shard_id)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint has no weights for {len(missing)} parameters, e.g. {missing[:5]}")


def _stage_owns(model: LlamaModel, name: str) -> bool:
    """Whether the parameter `name` lives on this pipeline stage."""
    layer = _layer_index(name)
    if layer is not None:
        return layer in model.layer_indices
    if name.startswith("model.embed_tokens."):
        return hasattr(model, "embed_tokens")
    if name.startswith(("model.norm.", "lm_head.")):
        return model.is_last_stage
    return True


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] else None


def _param_name(hf_name: str) -> tuple[str, Any]:
    """Our parameter name and shard id for an HF checkpoint name."""
    for hf_part, (ours, shard_id) in STACKED_PARAMS.items():
        if hf_part in hf_name:
            return hf_name.replace(hf_part, ours), shard_id
    return hf_name, None


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama's architecture; v0.1 attends over a sliding window of
    4,096 tokens (LlamaSpec.sliding_windows), v0.2+ over everything."""
