"""The real default model (SmolLM2-135M-Instruct GGUF) against transformers
loading the same file, and text-level features that need its tokenizer."""
from __future__ import annotations

import os

import pytest
import torch

import fleet
from fleet import SamplingParams
from fleet.config.cpu_class import cpu_computes_bfloat16
from fleet.config.model_files import default_model_path
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes
from fleet.tests.engine.oracle import hf_model, log_softmax

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def smollm2():
    llm = fleet.LLM(dtype="float32", device="cpu", kv_cache_memory_bytes="256M", max_model_len=2048)
    yield llm
    llm.shutdown()
    assert_no_fleet_processes()


def test_float32_greedy_tokens_are_transformers_best_or_near_it(smollm2):
    """The GGUF's blocks stay kept in float32 too: prefill steps multiply
    exact float32 tiles, decode steps round the activations to Q8 per block
    as llama.cpp does (about bfloat16's precision; tests/models/test_gguf.py
    bounds the logits), so the tokens are held to the rule of bfloat16."""
    outputs = smollm2.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32), use_tqdm=False)
    for output in outputs:
        assert output.outputs[0].text == smollm2.tokenizer.decode(output.outputs[0].token_ids, skip_special_tokens=True)
    assert_transformers_best_or_near_it(outputs)
    assert_all_blocks_free(smollm2)


@pytest.mark.parametrize("tp", [1, 3])
def test_bfloat16_greedy_tokens_are_transformers_best_or_near_it(tp):
    """In bfloat16 (what --dtype auto picks on a CPU with native bfloat16,
    where the GGUF weights stay in their blocks: kernels/quantized.py) the
    sums round differently from float32. With --tp 3 each rank keeps its
    slice of the blocks: rows of the column-parallel layers, whole blocks of
    the row-parallel ones' columns (576 / 3 and 1536 / 3 are multiples of 32)."""
    llm = fleet.LLM(dtype="bfloat16", device="cpu", tensor_parallel_size=tp, kv_cache_memory_bytes="64M",
                    max_model_len=512)
    try:
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24), use_tqdm=False)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()  # the module's fixture proves every process gone at its end
    # Below native bfloat16 (AVX2, AVX-512 without BF16) the bfloat16 activations are also
    # rounded to Q8 blocks for decode steps (csrc/gguf_linear_cpu.cpp), on top of bfloat16's own
    # rounding: there one token of "Once upon a time" came 0.40 nats below transformers' best.
    assert_transformers_best_or_near_it(outputs, near=0.25 if cpu_computes_bfloat16() else 0.5)


def assert_transformers_best_or_near_it(outputs, near: float = 0.25) -> None:
    """Sums that round differently from float32 transformers' may turn a near
    tie the other way: each greedy token must be float32 transformers' best
    choice for the same prefix, or within `near` nats of it, and nine in ten
    (over all the prompts' tokens) its best. (Weights 5 % off fail this.)"""
    path = default_model_path()
    model = hf_model(os.path.dirname(path), os.path.basename(path))
    best = []
    for output in outputs:
        prompt, generated = output.prompt_token_ids, output.outputs[0].token_ids
        logprobs = log_softmax(model, prompt + generated)[len(prompt) - 1 : -1]
        chosen = logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0]
        assert (logprobs.max(dim=1).values - chosen).max() < near, output.prompt
        best.append(logprobs.argmax(dim=1) == torch.tensor(generated))
    assert torch.cat(best).float().mean() > 0.9


def test_stop_string_is_left_out(smollm2):
    free = smollm2.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    words = free.text.split()
    stop = " " + words[len(words) // 2]
    stopped = smollm2.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text == free.text[: free.text.index(stop)]
    assert_all_blocks_free(smollm2)


def test_chat_answers(smollm2):
    output = smollm2.chat([{"role": "user", "content": "What is 2+2?"}], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert output.outputs[0].text.strip()
    assert output.outputs[0].finish_reason in ("stop", "length")

