"""Tiny Llama, Qwen3 and Gemma 3 GGUFs of K-quants, mixed as llama.cpp's
Q4_K_M mixes them, loaded by fleet in float32 with their K-quant weights kept
in their super-blocks, vs transformers loading the same file (dequantized by gguf-py): a prefill
longer than the kernel's INTEGER_ROWS gets its logits up to summation order, the decode steps after it
(whose activations are rounded to Q8_K) within the rounding's reach."""
from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch

from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import hf_config_from_gguf
from fleet.kernels.attention import AttentionMetadata
from fleet.kernels.cpu_extension import cpu_kernels
from fleet.kernels.quantized import KEPT_TYPES, keep_quantized
from fleet.workers.loader import gguf_weights, load_model
from fleet.workers.models.registry import get_model_class

Q4_K, Q5_K, Q6_K = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.Q6_K
HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 96
LAYER_TYPES = [
    # Q4_K_M: Q6_K for half the layers' attn_v and ffn_down, Q4_K elsewhere; one layer's FFN in Q5_K.
    {"attn_q": Q4_K, "attn_k": Q4_K, "attn_v": Q6_K, "attn_output": Q4_K, "ffn_gate": Q4_K, "ffn_up": Q4_K,
     "ffn_down": Q6_K},
    {"attn_q": Q4_K, "attn_k": Q4_K, "attn_v": Q4_K, "attn_output": Q4_K, "ffn_gate": Q5_K, "ffn_up": Q5_K,
     "ffn_down": Q4_K},
]
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
          "ffn_down": (HIDDEN, INTERMEDIATE)}
SCALE_OFFSETS = {Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,)}
"""Where each type's float16 d (and dmin) sit in its super-block."""
PROMPT = [1, 50, 7, 93, 12, 12, 64, 3, 88, 41, 5, 77, 20, 9, 60, 31, 2]


def random_blocks(gguf_type: gguf.GGMLQuantizationType, rows: int, columns: int,
                  rng: np.random.Generator) -> np.ndarray:
    """Valid random super-blocks (gguf-py cannot quantize into K-quants):
    random quants and packed scales, d and dmin small enough for weights of
    order 0.05."""
    blocks = rng.integers(0, 256, (rows, columns // 256, KEPT_TYPES[gguf_type].nbytes), dtype=np.uint8)
    for offset in SCALE_OFFSETS[gguf_type]:
        scale = rng.uniform(1e-5, 5e-5, (rows, columns // 256, 1)).astype(np.float16)
        blocks[..., offset : offset + 2] = scale.view(np.uint8)
    return blocks.reshape(rows, -1)


GEMMA3_WINDOW = 8
"""Shorter than PROMPT: the Gemma 3 file's (local) layers attend over a sliding window."""


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def kquant_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The file of architecture `request.param`; Qwen3's and Gemma 3's have per-head q/k norms too,
    Gemma 3's four norms a layer (holding 1 + w, as llama.cpp's converter writes them), tied embeddings
    and a sliding window."""
    arch = request.param
    path = os.fspath(tmp_path_factory.mktemp("kquant_gguf") / f"tiny-{arch}-q4_k_m.gguf")
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name("tiny-q4_k_m")
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(len(LAYER_TYPES))
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
    writer.add_key_length(HIDDEN // HEADS)
    writer.add_value_length(HIDDEN // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    if arch == "gemma3":
        writer.add_sliding_window(GEMMA3_WINDOW)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", random_blocks(Q6_K, VOCAB, HIDDEN, rng), raw_dtype=Q6_K)
    for layer, types in enumerate(LAYER_TYPES):
        for part, gguf_type in types.items():
            writer.add_tensor(f"blk.{layer}.{part}.weight", random_blocks(gguf_type, *SHAPES[part], rng),
                              raw_dtype=gguf_type)
        norms = ("attn_norm", "ffn_norm") + (("post_attention_norm", "post_ffw_norm") if arch == "gemma3" else ())
        for norm in norms:
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        if arch in ("qwen3", "gemma3"):
            for norm in ("attn_q_norm", "attn_k_norm"):
                writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN // HEADS).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    if arch != "gemma3":  # Gemma ties its output to the embeddings
        writer.add_tensor("output.weight", random_blocks(Q6_K, VOCAB, HIDDEN, rng), raw_dtype=Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def kept_float32_model(path: str):
    """fleet's float32 model of the file as a CPU worker loads it: K-quant blocks kept."""
    hf_config = hf_config_from_gguf(path)
    model_config = ModelConfig(model=path, model_path=path, architecture=hf_config["architectures"][0],
                               hf_config=hf_config, dtype="float32")
    if not model_config.keeps_gguf_blocks("cpu"):
        pytest.skip("GGUF blocks stay quantized only on a CPU of class avx2 or above")
    return load_model(model_config, LoadConfig(load_format="gguf"), torch.float32, torch.device("cpu"))


@torch.inference_mode()
def test_kept_k_quants_match_transformers(kquant_gguf: str) -> None:
    from transformers import AutoModelForCausalLM

    if cpu_kernels() is None:
        pytest.skip("the CPU kernel extension cannot be built here")
    ours = kept_float32_model(kquant_gguf)
    gemma = hf_config_from_gguf(kquant_gguf)["model_type"] == "gemma3_text"
    kept = {name: param.gguf_type if param.gguf_type is not None else [part.gguf_type for part in param.gguf_parts]
            for name, param in ours.named_parameters() if param.dtype == torch.uint8}
    # Layer 0's q/k/v mix Q4_K and Q6_K in one fused projection: kept as two parts.
    assert kept == {
        "model.embed_tokens.weight": Q6_K, **({} if gemma else {"lm_head.weight": Q6_K}),
        "model.layers.0.self_attn.qkv_proj.weight": [Q4_K, Q6_K], "model.layers.0.self_attn.o_proj.weight": Q4_K,
        "model.layers.0.mlp.gate_up_proj.weight": Q4_K, "model.layers.0.mlp.down_proj.weight": Q6_K,
        "model.layers.1.self_attn.qkv_proj.weight": Q4_K, "model.layers.1.self_attn.o_proj.weight": Q4_K,
        "model.layers.1.mlp.gate_up_proj.weight": Q5_K, "model.layers.1.mlp.down_proj.weight": Q4_K,
    }
    # A prefill of more than INTEGER_ROWS tokens multiplies exact float32 tiles; the decode steps after it
    # round their activations to Q8_K (on class avx2 and up).
    prompt, decoded = PROMPT * 2, PROMPT[:3]
    block_size, num_tokens = 16, len(prompt)
    kv_caches = [torch.zeros(2, 4, block_size, ours.num_kv_heads, ours.head_dim) for _ in range(ours.num_layers)]
    tables = [[2, 1, 3]]
    meta = AttentionMetadata.build([num_tokens], [num_tokens], tables, block_size)
    logits = ours.compute_logits(ours(torch.tensor(prompt), torch.arange(num_tokens), kv_caches, meta))
    steps = []
    for position, token in enumerate(decoded, start=num_tokens):
        meta = AttentionMetadata.build([1], [position + 1], tables, block_size)
        steps.append(ours.compute_logits(ours(torch.tensor([token]), torch.tensor([position]), kv_caches, meta)))

    # transformers reads no head_dim from a qwen3 GGUF, and scales Gemma 3's queries by its config's default
    # (fleet, as llama.cpp, by head_dim)
    gemma_scale = {"query_pre_attn_scalar": HIDDEN // HEADS} if gemma else {}
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(kquant_gguf), gguf_file=os.path.basename(kquant_gguf), dtype=torch.float32,
        head_dim=HIDDEN // HEADS, **gemma_scale,
    ).eval()
    if gemma:
        assert hf.config.sliding_window == GEMMA3_WINDOW < len(PROMPT)
    expected = hf(torch.tensor([prompt + decoded])).logits[0]
    assert expected.abs().max() > 0.5  # the comparison is not of near-zero logits
    torch.testing.assert_close(logits, expected[:num_tokens], atol=1e-4, rtol=1e-4)
    # Each decode step rounds the activations of nine matmuls (four a layer and the head), each value by up to
    # 1/254 of its super-block's largest: about 1 % of the largest logit here. A wrong scale or offset moves
    # the logits by their own size.
    decode_error = (torch.cat(steps) - expected[num_tokens:]).abs().max(dim=1).values
    assert (decode_error <= 0.03 * expected[num_tokens:].abs().max(dim=1).values).all(), decode_error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_dequantizes_k_quants(kquant_gguf: str) -> None:
    """The Triton kernel reads no K-quants: on CUDA none stay in their blocks."""
    hf_config = hf_config_from_gguf(kquant_gguf)
    model = get_model_class(hf_config["architectures"][0])(hf_config, torch.float32, "cuda")
    assert keep_quantized(model, list(gguf_weights(kquant_gguf))) == 0
