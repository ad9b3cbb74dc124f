"""FLEET_CPU_ISA reaches the worker process: its start-up line names the
class and torch's own capability there, and the engine serves transformers'
greedy tokens in float32 and, with bfloat16 emulated, near them."""
from __future__ import annotations

import pytest
import torch

import fleet
from fleet import SamplingParams
from fleet.config.cpu_class import CpuClass, machine_cpu_class
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, random_prompts
from fleet.tests.engine.oracle import greedy, hf_model, log_softmax

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(machine_cpu_class() < CpuClass.avx2, reason="this CPU is below the AVX2 class"),
]

TOKENS = 12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_avx2_class_reaches_the_worker_and_serves_the_oracles_tokens(tiny_llama_dir, dtype, capfd, monkeypatch):
    monkeypatch.setenv("FLEET_CPU_ISA", "avx2")  # read by the engine and worker processes this LLM starts
    model = hf_model(str(tiny_llama_dir))
    prompts = random_prompts(3, model.config.vocab_size, seed=7, min_len=5, max_len=40)
    with fleet.LLM(str(tiny_llama_dir), dtype=dtype, device="cpu", kv_cache_memory_bytes="8M") as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=TOKENS, min_tokens=TOKENS),
                               use_tqdm=False)
        assert_all_blocks_free(llm)
    assert_no_fleet_processes()
    log = capfd.readouterr().err
    assert "CPU class avx2 (chosen by FLEET_CPU_ISA" in log and "torch capability AVX2" in log, log[-3000:]
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = list(output.outputs[0].token_ids)
        if dtype == "float32":
            assert tokens == greedy(model, prompt, TOKENS)
            continue
        # bfloat16 rounds each sum: every token is transformers' best or within 0.25 nats of it (same prefix).
        logprobs = log_softmax(model, prompt + tokens)[len(prompt) - 1 : -1]
        chosen = logprobs.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        assert (logprobs.max(dim=1).values - chosen).max() <= 0.25
    if dtype == "bfloat16":
        assert "bfloat16 is emulated" in log
