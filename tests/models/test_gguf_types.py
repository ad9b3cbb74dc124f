"""Tiny Llama GGUFs of the 32-weight types llama-quantize falls back to (Q5_0,
Q5_1, Q8_0 where a row is not a multiple of 256) and of IQ4_NL, one file per
type, one that mixes types inside the fused projections, and one each of the
super-block types gguf-py cannot write (Q2_K, Q3_K, IQ4_XS, from
kquant_blocks.py; rows of 256 and 512 weights): fleet's float32 model, with
the blocks kept, vs transformers loading the same file (dequantized by gguf-py).

A 40-token prefill takes the kernels' exact float32 path (more than 32 rows:
csrc/gguf_linear_cpu.cpp's Q8_ROWS, quantized.py's KQUANT_INTEGER_ROWS), so
the logits match up to summation order (atol 1e-4); a decode step of one row
rounds its activations to Q8 blocks (Q8_K for the super-blocks) on AVX2
classes (tests/kernels/ check that rounding closely), which moves the
logits through these two layers by a few % of the largest one (Dims.decode_bound).
Below AVX2 the blocks are dequantized at load, and the same comparisons hold."""
from __future__ import annotations

import os
from typing import NamedTuple

import gguf
import numpy as np
import pytest
import torch

from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import hf_config_from_gguf
from fleet.kernels.attention import AttentionMetadata
from fleet.kernels.cpu_extension import cpu_kernels
from fleet.tests.kernels.test_gguf_linear import iq4_nl_blocks
from fleet.tests.models.kquant_blocks import QUANTIZERS
from fleet.workers.loader import load_model

T = gguf.GGMLQuantizationType
KV_HEADS, VOCAB = 1, 80
PARTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


class Dims(NamedTuple):
    """A file's model sizes, and how far a decode step may be from transformers there."""

    hidden: int
    intermediate: int
    heads: int
    decode_bound: float
    """Of the largest logit: what rounding the decode step's activations moves the logits by at most."""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def shape(self, part: str) -> tuple[int, int]:
        """The [rows, columns] of a layer's tensor `part`."""
        kv = KV_HEADS * self.head_dim
        return {"attn_q": (self.hidden, self.hidden), "attn_k": (kv, self.hidden), "attn_v": (kv, self.hidden),
                "attn_output": (self.hidden, self.hidden), "ffn_gate": (self.intermediate, self.hidden),
                "ffn_up": (self.intermediate, self.hidden), "ffn_down": (self.hidden, self.intermediate)}[part]


FALLBACK = Dims(96, 160, 3, decode_bound=0.04)
"""Rows of 96 and 160 weights: not multiples of 256, as where llama-quantize
falls back. Q8_0 rounds each 32 activations: 0.7-2.1 % of the largest logit."""
SUPER_BLOCKS = Dims(256, 512, 4, decode_bound=0.08)
"""Rows of whole super-blocks. Q8_K rounds each 256 activations, on their
largest: Q2_K 4.9 %, Q3_K 2.8 %, IQ4_XS 2.9 % of the largest logit, which the
kernels give within 2e-7 of the rounded activations' products."""


def one_type(gguf_type: T) -> dict[str, T]:
    return dict.fromkeys(PARTS, gguf_type)


MIXED = {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.IQ4_NL, "ffn_gate": T.Q4_0,
         "ffn_up": T.Q5_1, "ffn_down": T.Q8_0}
"""Fused projections whose parts differ: q/k Q5_0 with v Q8_0 (as Q4_K_M's
Q4_K q/k with Q6_K v), gate Q4_0 with up Q5_1."""
FILES = {  # name -> (embedding type, per-layer types, sizes)
    "q5_0": (T.Q8_0, [one_type(T.Q5_0), one_type(T.Q5_0)], FALLBACK),
    "q5_1": (T.Q5_1, [one_type(T.Q5_1), one_type(T.Q5_1)], FALLBACK),
    "iq4_nl": (T.IQ4_NL, [one_type(T.IQ4_NL), one_type(T.IQ4_NL)], FALLBACK),
    "mixed": (T.Q8_0, [MIXED, one_type(T.Q5_1)], FALLBACK),
    **{gguf_type.name.lower(): (gguf_type, [one_type(gguf_type), one_type(gguf_type)], SUPER_BLOCKS)
       for gguf_type in QUANTIZERS},
}
PROMPT = [1, 50, 7, 73, 12, 12, 64, 3, 68, 41, 5, 77, 20, 9, 60, 31, 2, 44, 18, 6] * 2


def blocks_of(gguf_type: T, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Normal weights of scale 0.1 in `gguf_type`'s blocks (IQ4_NL's, which
    gguf-py cannot write, as the kernel tests make them; Q2_K's, Q3_K's and
    IQ4_XS's by kquant_blocks.py)."""
    weights = 0.1 * rng.standard_normal((rows, columns)).astype(np.float32)
    if gguf_type == T.IQ4_NL:
        return iq4_nl_blocks(weights)
    if gguf_type in QUANTIZERS:
        return QUANTIZERS[gguf_type](weights)
    return gguf.quants.quantize(weights, gguf_type)


def write_llama_gguf(path: str, embedding: T, layer_types: list[dict[str, T]], dims: Dims) -> str:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-types")
    writer.add_context_length(128)
    writer.add_embedding_length(dims.hidden)
    writer.add_block_count(len(layer_types))
    writer.add_feed_forward_length(dims.intermediate)
    writer.add_head_count(dims.heads)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(dims.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_tensor("token_embd.weight", blocks_of(embedding, VOCAB, dims.hidden, rng), raw_dtype=embedding)
    for layer, types in enumerate(layer_types):
        for part, gguf_type in types.items():
            blocks = blocks_of(gguf_type, *dims.shape(part), rng)
            writer.add_tensor(f"blk.{layer}.{part}.weight", blocks, raw_dtype=gguf_type)
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", rng.uniform(0.5, 1.5, dims.hidden).astype(np.float32))
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, dims.hidden).astype(np.float32))
    writer.add_tensor("output.weight", blocks_of(embedding, VOCAB, dims.hidden, rng), raw_dtype=embedding)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module", params=list(FILES))
def types_gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    path = os.fspath(tmp_path_factory.mktemp("types_gguf") / f"tiny-llama-{request.param}.gguf")
    return request.param, write_llama_gguf(path, *FILES[request.param])


def expected_kept(name: str) -> dict[str, object]:
    """Parameter -> its kept type, or the types of its parts, as fleet holds the file `name` on a CPU."""
    embedding, layers, _ = FILES[name]
    kept: dict[str, object] = {"model.embed_tokens.weight": int(embedding), "lm_head.weight": int(embedding)}
    for layer, types in enumerate(layers):
        prefix = f"model.layers.{layer}."
        qkv = [int(types[part]) for part in ("attn_q", "attn_k", "attn_v")]
        gate_up = [int(types["ffn_gate"]), int(types["ffn_up"])]
        kept[prefix + "self_attn.qkv_proj.weight"] = qkv[0] if len(set(qkv)) == 1 else [qkv[0], qkv[2]]
        kept[prefix + "self_attn.o_proj.weight"] = int(types["attn_output"])
        kept[prefix + "mlp.gate_up_proj.weight"] = gate_up[0] if len(set(gate_up)) == 1 else gate_up
        kept[prefix + "mlp.down_proj.weight"] = int(types["ffn_down"])
    return kept


def held_types(model: torch.nn.Module) -> dict[str, object]:
    return {name: p.gguf_type if p.gguf_type is not None else [part.gguf_type for part in p.gguf_parts]
            for name, p in model.named_parameters() if p.dtype == torch.uint8}


@torch.inference_mode()
def test_kept_types_match_transformers(types_gguf: tuple[str, str]) -> None:
    from transformers import AutoModelForCausalLM

    name, path = types_gguf
    if cpu_kernels() is None:
        pytest.skip("the CPU kernel extension cannot be built here")
    hf_config = hf_config_from_gguf(path)
    model_config = ModelConfig(model=path, model_path=path, architecture=hf_config["architectures"][0],
                               hf_config=hf_config, dtype="float32")
    ours = load_model(model_config, LoadConfig(load_format="gguf"), torch.float32, torch.device("cpu"))
    assert held_types(ours) == (expected_kept(name) if model_config.keeps_gguf_blocks("cpu") else {})

    block_size, num_tokens = 16, len(PROMPT)
    kv_caches = [torch.zeros(2, 4, block_size, ours.num_kv_heads, ours.head_dim) for _ in range(ours.num_layers)]
    prefill = num_tokens - 1
    meta = AttentionMetadata.build([prefill], [prefill], [[2, 1, 3]], block_size)
    logits = ours.compute_logits(ours(torch.tensor(PROMPT[:prefill]), torch.arange(prefill), kv_caches, meta))
    meta = AttentionMetadata.build([1], [num_tokens], [[2, 1, 3]], block_size)
    decoded = ours.compute_logits(ours(torch.tensor(PROMPT[-1:]), torch.tensor([prefill]), kv_caches, meta))

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    expected = hf(torch.tensor([PROMPT])).logits[0]
    assert expected.abs().max() > 0.5  # the comparison is not of near-zero logits
    torch.testing.assert_close(logits, expected[:prefill], atol=1e-4, rtol=1e-4)
    error = (decoded[0] - expected[-1]).abs().max()
    assert error <= FILES[name][2].decode_bound * expected[-1].abs().max(), error


def test_the_plan_counts_the_tensors_as_the_worker_holds_them(types_gguf: tuple[str, str]) -> None:
    """`fleet plan` (core/launch/memory.py, from the file's tensor index) says per
    type how the worker will hold the tensors, as the loaded model does
    (`gguf_holding`, what its start-up line lists), and counts their bytes
    for the weights: with every type kept, within 10 % of the file's tensor
    bytes (and of the loaded parameters' either way)."""
    from fleet.config import EngineArgs
    from fleet.core.launch.memory import gguf_holding, worker_weight_bytes
    from fleet.workers.gguf_file import read_gguf_tensors

    name, path = types_gguf
    if cpu_kernels() is None:
        pytest.skip("the CPU kernel extension cannot be built here")
    config = EngineArgs(model=path, device="cpu", dtype="float32").create_config()
    ours = load_model(config.model, config.load, torch.float32, torch.device("cpu"))
    assert gguf_holding(config) == ours.gguf_holding
    kept = config.model.keeps_gguf_blocks("cpu")
    assert all(held.dequantized == 0 for type_name, held in ours.gguf_holding.items() if type_name != "F32") == kept
    planned = worker_weight_bytes(config)
    assert planned == pytest.approx(sum(p.nbytes for p in ours.parameters()), rel=0.1)
    if kept:
        assert planned == pytest.approx(sum(t.data.nbytes for t in read_gguf_tensors(path)), rel=0.1)
