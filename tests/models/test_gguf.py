"""Our Llama loaded from the default SmolLM2 GGUF vs transformers loading the same file."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import default_model_path, hf_config_from_gguf
from fleet.kernels.attention import AttentionMetadata
from fleet.tests.engine.oracle import hf_model
from fleet.workers.loader import gguf_to_hf_name, load_model, unpermute_qk_rows

PROMPT = [1, 504, 3458, 282, 4235, 314, 1345, 30, 378, 2075, 28, 2640, 17, 4470, 4071, 4811, 314]


@pytest.fixture(scope="module")
def gguf_path() -> str:
    try:
        return default_model_path()
    except ValueError as error:
        pytest.skip(str(error))


@torch.inference_mode()
def test_logits_match_transformers(gguf_path: str) -> None:
    """A float32 prefill of more than 32 tokens multiplies exact float32
    tiles of the kept blocks: transformers' logits up to summation order.
    (Steps of fewer rows round the activations to Q8: the test below.)"""

    hf_config = hf_config_from_gguf(gguf_path)
    model_config = ModelConfig(model=gguf_path, model_path=gguf_path, architecture=hf_config["architectures"][0],
                               hf_config=hf_config)
    ours = load_model(model_config, LoadConfig(load_format="gguf"), torch.float32, torch.device("cpu"))
    prompt = PROMPT * 2
    block_size, num_tokens = 16, len(prompt)
    kv_caches = [torch.zeros(2, 4, block_size, ours.num_kv_heads, ours.head_dim) for _ in range(ours.num_layers)]
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[2, 1, 3]], block_size)
    hidden = ours(torch.tensor(prompt), torch.arange(num_tokens), kv_caches, meta)
    logits = ours.compute_logits(hidden)  # [T, vocab]

    hf = hf_model(os.path.dirname(gguf_path), os.path.basename(gguf_path))
    expected = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(logits, expected, atol=1e-3, rtol=0)
    assert logits[-1].argmax() == expected[-1].argmax()


def test_name_mapping() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.3.unknown.weight") is None


def test_unpermute_inverts_llama_cpp_permute() -> None:
    num_heads, head_dim, hidden = 3, 8, 5
    weight = torch.randn(num_heads * head_dim, hidden)
    # llama.cpp convert_hf_to_gguf.py: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
    permuted = weight.reshape(num_heads, 2, head_dim // 2, hidden).transpose(1, 2).reshape(weight.shape)
    assert torch.equal(unpermute_qk_rows(permuted, num_heads), weight)


def test_fleet_prepare_keeps_the_tokenizer(gguf_path: str, tmp_path) -> None:
    """`fleet prepare` (what `make install` runs) leaves the converted
    tokenizer in fleet's cache, so that the first launch reads it instead of
    converting the GGUF vocabulary; the weights need nothing."""
    cache = tmp_path / "fleet-cache"
    done = subprocess.run(
        [sys.executable, "-P", "-m", "fleet.frontend.cli", "prepare", "--dtype", "float32", "--device", "cpu"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "FLEET_CACHE_DIR": str(cache)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert list((cache / "gguf-tokenizer").glob("*/tokenizer_config.json"))
    assert not list(cache.glob("gguf-weights*"))


@torch.inference_mode()
def test_bfloat16_weights_stay_in_their_blocks_as_near_as_the_dequantized_model(gguf_path: str) -> None:
    """A bfloat16 model keeps its Q4_1 layers and its Q8_0 embedding / LM
    head in the file's blocks: it holds about the file's bytes. Its sums
    round differently from the dequantized model's (the kernel skips
    rounding each weight to bfloat16, or, below AVX512-BF16, rounds the
    activations to Q8 for steps of few rows), so the stated tolerance is
    relative, for a prefill and for decode steps: the kept model is no
    further from the float32 one than the dequantized bfloat16 model is
    (mean absolute logit error within 1.25 times its), and picks the float32
    model's greedy token as often, within 3 %."""
    reference = _prefill_and_decode(_model(gguf_path, torch.float32, False), torch.float32)
    kept = _kept_model(gguf_path, torch.bfloat16)
    kept16 = _prefill_and_decode(kept, torch.bfloat16).float()
    dequantized16 = _prefill_and_decode(_model(gguf_path, torch.bfloat16, False), torch.bfloat16).float()
    kept_error, dequantized_error = (kept16 - reference).abs().mean(), (dequantized16 - reference).abs().mean()
    assert kept_error <= 1.25 * dequantized_error, (kept_error, dequantized_error)
    best = reference.argmax(dim=1)
    kept_agree = (kept16.argmax(dim=1) == best).float().mean()
    dequantized_agree = (dequantized16.argmax(dim=1) == best).float().mean()
    assert kept_agree >= dequantized_agree - 0.03, (kept_agree, dequantized_agree)


def test_float32_weights_stay_in_their_blocks_exact_for_prefill_and_near_for_decode(gguf_path: str) -> None:
    """A float32 model keeps the blocks too. Its 68-token prefill multiplies
    exact float32 tiles (the dequantized model's logits up to summation
    order); its decode steps round each activation block to Q8 as llama.cpp
    does, which keeps about bfloat16's precision: their logits are no
    further from the dequantized float32 model's than twice the dequantized
    bfloat16 model's are, and pick the same greedy tokens."""
    reference = _prefill_and_decode(_model(gguf_path, torch.float32, False), torch.float32)
    kept32 = _prefill_and_decode(_kept_model(gguf_path, torch.float32), torch.float32)
    dequantized16 = _prefill_and_decode(_model(gguf_path, torch.bfloat16, False), torch.bfloat16).float()
    prefill = len(PROMPT) * 4
    torch.testing.assert_close(kept32[:prefill], reference[:prefill], atol=1e-3, rtol=0)
    kept_error = (kept32[prefill:] - reference[prefill:]).abs().mean()
    dequantized_error = (dequantized16[prefill:] - reference[prefill:]).abs().mean()
    assert 0 < kept_error <= 2 * dequantized_error, (kept_error, dequantized_error)
    assert torch.equal(kept32[prefill:].argmax(dim=1), reference[prefill:].argmax(dim=1))


def _kept_model(gguf_path: str, dtype: torch.dtype):
    """The default model as fleet loads it on this CPU class: Q4_1 layers and
    the Q8_0 embedding / LM head in the file's blocks, about the file's bytes."""
    hf_config = hf_config_from_gguf(gguf_path)
    model_config = ModelConfig(model=gguf_path, model_path=gguf_path, hf_config=hf_config,
                               dtype=str(dtype).removeprefix("torch."))
    if not model_config.keeps_gguf_blocks("cpu"):
        pytest.skip("GGUF blocks stay quantized only on a CPU of class avx2 or above")
    kept = _model(gguf_path, dtype, True)
    assert sum(p.dtype == torch.uint8 for p in kept.parameters()) == 4 * kept.spec.num_layers + 1
    assert sum(p.nbytes for p in kept.parameters()) < 1.05 * os.path.getsize(gguf_path)
    assert all(getattr(m, "decode_weight", None) is None for m in kept.modules())
    # On AMX a bfloat16 model's layers also hold their blocks in bfloat16 for steps of many rows (the prefill here).
    amx_copies = [m.amx_weight is not None for m in kept.modules() if hasattr(m, "amx_weight")]
    assert len(amx_copies) == 4 * kept.spec.num_layers + 1
    assert set(amx_copies) == {model_config.keeps_amx_gemm_copies("cpu")}
    return kept


def _model(gguf_path: str, dtype: torch.dtype, keep_blocks: bool):
    """The default model as fleet loads it (blocks kept), or with every weight
    dequantized (what fleet loaded before, bfloat16 decode copies included)."""
    from fleet.kernels.linear import keep_bfloat16_decode_weights
    from fleet.kernels.quantized import GGUFWeight
    from fleet.workers.loader import gguf_weights
    from fleet.workers.models.registry import get_model_class

    hf_config = hf_config_from_gguf(gguf_path)
    model_config = ModelConfig(model=gguf_path, model_path=gguf_path, architecture=hf_config["architectures"][0],
                               hf_config=hf_config, dtype=str(dtype).removeprefix("torch."))
    if keep_blocks:
        return load_model(model_config, LoadConfig(load_format="gguf"), dtype, torch.device("cpu"))
    model = get_model_class(hf_config["architectures"][0])(hf_config, dtype, "cpu")
    model.load_weights((name, w.dequantize(torch.float32) if isinstance(w, GGUFWeight) else w)
                       for name, w in gguf_weights(gguf_path))
    if model_config.keeps_bfloat16_decode_weights("cpu"):
        keep_bfloat16_decode_weights(model)
    return model.eval()


def _prefill_and_decode(model, dtype: torch.dtype) -> torch.Tensor:
    """Logits of a 68-token prefill (a step of many rows) and of 8 decode steps of 1 row."""
    block_size, prompt = 16, PROMPT * 4
    kv_caches = [torch.zeros(2, 8, block_size, model.num_kv_heads, model.head_dim, dtype=dtype)
                 for _ in range(model.num_layers)]
    tables = [[1, 2, 3, 4, 5]]
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], tables, block_size)
    logits = [model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), kv_caches, meta))]
    for step in range(8):
        position = len(prompt) + step
        meta = AttentionMetadata.build([1], [position + 1], tables, block_size)
        logits.append(model.compute_logits(model(torch.tensor([PROMPT[step]]), torch.tensor([position]), kv_caches,
                                                 meta)))
    return torch.cat(logits)


def test_tensor_index_is_gguf_py_readers(gguf_path: str) -> None:
    """workers/gguf_file.py steps over the metadata that gguf-py parses: the
    same tensors, shapes, types and bytes."""
    import gguf

    from fleet.workers.gguf_file import read_gguf_tensors

    ours = read_gguf_tensors(gguf_path)
    theirs = gguf.GGUFReader(gguf_path).tensors
    assert [t.name for t in ours] == [t.name for t in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert mine.shape == tuple(int(d) for d in reversed(reference.shape)) and mine.gguf_type == reference.tensor_type
        assert mine.data.tobytes() == reference.data.tobytes(), mine.name
