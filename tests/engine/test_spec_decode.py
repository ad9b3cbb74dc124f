"""Speculative decoding (--speculative-config, method ngram) through fleet.LLM: engine core and
workers in their own processes, drafts proposed from each sequence's own text, verified in the
forward, and the outputs compared with transformers decoding one token at a time.

The model is the tiny Llama whose attention adds little (tiny_cycling_llama_dir): its greedy text
soon repeats, so drafts are often right and sometimes wrong, and both paths run."""
from __future__ import annotations

import random

import psutil
import pytest

import fleet
from fleet import SamplingParams
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, fleet_children
from fleet.tests.engine.oracle import greedy, hf_model, log_softmax

pytestmark = pytest.mark.slow

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
NUM_TOKENS = 48


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 512) for _ in range(rng.randrange(5, 40))] for _ in range(count)]


def start(model_dir: str, **kwargs) -> fleet.LLM:
    return fleet.LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=64, max_num_seqs=16,
                     kv_cache_memory_bytes="8M", speculative_config=NGRAM, **kwargs)


@pytest.fixture(scope="module")
def llm(tiny_cycling_llama_dir):
    llm = start(tiny_cycling_llama_dir)
    yield llm
    llm.shutdown()
    assert_no_fleet_processes()


@pytest.fixture(scope="module")
def model(tiny_cycling_llama_dir):
    return hf_model(tiny_cycling_llama_dir)


def spec_counts(llm: fleet.LLM) -> dict[str, int]:
    return llm.call_utility("spec_decode_stats")


def test_greedy_tokens_and_logprobs_are_transformers(llm, model):
    """Every token and its logprob as transformers computes them one token at a time: a draft's
    key or value left wrong in the cache (rejected, or at a wrong position) shows in the logprobs."""
    before = spec_counts(llm)
    batch = prompts(8, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, logprobs=2)
    outputs = llm.generate(batch, params, use_tqdm=False)
    for prompt, output in zip(batch, outputs):
        sequence = output.outputs[0]
        assert sequence.token_ids == greedy(model, prompt, NUM_TOKENS)
        reference = log_softmax(model, prompt + sequence.token_ids)
        for step, (token, top) in enumerate(zip(sequence.token_ids, sequence.logprobs, strict=True)):
            assert top[token].logprob == pytest.approx(reference[len(prompt) - 1 + step][token].item(), abs=1e-4)
    after = spec_counts(llm)
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    accepted = after["num_accepted_tokens"] - before["num_accepted_tokens"]
    assert 0 < accepted < drafted, after  # drafts were kept and drafts were thrown away
    assert accepted > len(batch) * NUM_TOKENS // 10  # the point of it: many tokens came without a step of their own
    assert_all_blocks_free(llm)


def test_penalties_and_stop_strings_see_the_drafts(llm, model):
    """A kept draft counts as output for the tokens after it (repetition penalty); a stop string
    completed by a draft ends the output there, dropping the step's later tokens."""
    prompt = prompts(1, seed=3)[0]
    penalised = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24, repetition_penalty=1.3)
    output = llm.generate([prompt], penalised, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == greedy(model, prompt, 24, repetition_penalty=1.3)

    reference = greedy(model, prompt, NUM_TOKENS)
    text = llm.tokenizer.decode(reference)
    stop = text[len(text) * 2 // 3 :][:3]  # late in the text, where the drafts are kept
    end = next(m for m in range(1, NUM_TOKENS + 1) if stop in llm.tokenizer.decode(reference[:m]))
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS, stop=[stop])
    sequence = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert sequence.finish_reason == "stop" and sequence.stop_reason == stop
    assert sequence.token_ids == reference[:end]
    assert sequence.text == text[: text.index(stop)]


def test_sampling_with_drafts_is_seeded_and_complete(llm):
    """Sampled requests verify drafts too (the distribution: tests/workers/test_spec_decode.py);
    a seed gives the same text twice, and every request gets its max_tokens."""
    batch = prompts(6, seed=4)
    params = SamplingParams(temperature=0.7, top_k=20, max_tokens=32, min_tokens=32, seed=7)
    first, second = (llm.generate(batch, params, use_tqdm=False) for _ in range(2))
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert all(len(o.outputs[0].token_ids) == 32 for o in first)
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp2", "pp2"])
def test_greedy_with_drafts_over_tensor_and_pipeline_parallel_workers(tiny_cycling_llama_dir, model, layout):
    others = {process.pid for process in fleet_children()}  # the module's LLM
    parallel = start(tiny_cycling_llama_dir, **layout)
    try:
        batch = prompts(4, seed=5)
        params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
        outputs = parallel.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [greedy(model, p, NUM_TOKENS) for p in batch]
        assert spec_counts(parallel)["num_accepted_tokens"] > 0
        assert_all_blocks_free(parallel)
    finally:
        parallel.shutdown()
    _, alive = psutil.wait_procs([p for p in fleet_children() if p.pid not in others], timeout=10)
    assert not alive, f"processes left behind: {alive}"
