"""Decode steps on a CPU multiply packed bfloat16 copies of the linear
weights (kernels/linear.py), prefill the model's own: for a bfloat16
checkpoint served in float32, greedy outputs stay transformers' (float32,
from the same checkpoint); a bfloat16 model keeps copies of any checkpoint."""
from __future__ import annotations

import pytest
import torch

import fleet
from fleet import SamplingParams
from fleet.config.cpu_class import cpu_computes_bfloat16, cpu_has_avx512
from fleet.config.load import LoadConfig
from fleet.config.model import ModelConfig
from fleet.config.model_files import read_hf_config
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, random_prompts
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.workers.loader import load_model


def load(model_dir: str, dtype: str) -> torch.nn.Module:
    hf_config = read_hf_config(model_dir)
    config = ModelConfig(model=model_dir, model_path=model_dir, architecture=hf_config["architectures"][0],
                         hf_config=hf_config, dtype=dtype)
    return load_model(config, LoadConfig(), getattr(torch, dtype), torch.device("cpu"))


def loaded_layers_with_copies(model_dir: str, dtype: str = "float32") -> tuple[int, int]:
    takers = [m for m in load(model_dir, dtype).modules() if hasattr(m, "decode_weight")]
    return len(takers), sum(m.decode_weight is not None for m in takers)


def test_only_a_bfloat16_checkpoint_gets_copies(tiny_bf16_qwen2_dir, tiny_qwen2_dir):
    takers, copies = loaded_layers_with_copies(tiny_bf16_qwen2_dir)
    assert takers > 0  # qkv, o, gate_up, down of every layer and the (tied) head
    assert copies == (takers if cpu_has_avx512() else 0)  # the kernel's fast path needs AVX-512
    assert loaded_layers_with_copies(tiny_qwen2_dir)[1] == 0  # float32 checkpoint: a copy would round


def test_a_bfloat16_model_gets_copies_of_any_checkpoint(tiny_qwen2_dir):
    takers, copies = loaded_layers_with_copies(tiny_qwen2_dir, "bfloat16")
    assert takers > 0 and copies == (takers if cpu_has_avx512() else 0)


def test_a_bfloat16_model_on_a_native_bfloat16_cpu_prepacks_all_but_the_tied_head(tiny_bf16_qwen2_dir):
    model = load(tiny_bf16_qwen2_dir, "bfloat16")
    takers = [m for m in model.modules() if hasattr(m, "decode_weight")]
    prepacked = [m for m in takers if m.weight.is_mkldnn]
    assert len(prepacked) == (len(takers) - 1 if cpu_computes_bfloat16() else 0)
    assert not model.model.embed_tokens.weight.is_mkldnn  # shared with the LM head
    assert not load(tiny_bf16_qwen2_dir, "float32").model.layers["0"].mlp.down_proj.weight.is_mkldnn


@pytest.mark.slow
def test_greedy_matches_transformers(tiny_bf16_qwen2_dir):
    llm = fleet.LLM(tiny_bf16_qwen2_dir, dtype="float32", device="cpu", max_num_seqs=16,
                    kv_cache_memory_bytes="8M")
    try:
        model = hf_model(tiny_bf16_qwen2_dir)
        params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10)
        for count in (1, 5, 12):  # decode steps of 1, 5 and 12 rows; prefill steps of more, in float32
            prompts = random_prompts(count, model.config.vocab_size, seed=count, max_len=60)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            for prompt, output in zip(prompts, outputs, strict=True):
                assert output.outputs[0].token_ids == greedy(model, prompt, 10)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
    assert_no_fleet_processes()
