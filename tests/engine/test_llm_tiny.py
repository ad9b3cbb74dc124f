"""fleet.LLM on tiny random-weight models: engine core and worker in their own
processes, outputs compared with transformers."""
from __future__ import annotations

import threading
import time

import pytest
import torch

import fleet
from fleet import SamplingParams
from fleet.core.sampling_params import InvalidParameter
from fleet.tests.engine.helpers import assert_all_blocks_free, assert_no_fleet_processes, random_prompts
from fleet.tests.engine.oracle import greedy, hf_model, log_softmax

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def llm_and_model(request):
    model_dir = str(request.getfixturevalue(request.param))
    llm = fleet.LLM(
        model_dir,
        dtype="float32",
        device="cpu",
        max_num_batched_tokens=64,  # forces chunked prefill
        max_num_seqs=16,
        enable_prefix_caching=True,
        kv_cache_memory_bytes="8M",
    )
    yield llm, hf_model(model_dir)
    llm.shutdown()
    assert_no_fleet_processes()


def test_greedy_batch_matches_transformers(llm_and_model):
    llm, model = llm_and_model
    prompts = random_prompts(16, model.config.vocab_size, seed=0, max_len=150)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        assert output.prompt_token_ids == prompt
        assert output.outputs[0].token_ids == greedy(model, prompt, 12)
        assert output.outputs[0].finish_reason == "length"
    assert_all_blocks_free(llm)


def test_logprobs_match_log_softmax(llm_and_model):
    llm, model = llm_and_model
    prompt = random_prompts(1, model.config.vocab_size, seed=1)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4, logprobs=5, prompt_logprobs=3)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    sequence = output.outputs[0]
    reference = log_softmax(model, prompt + sequence.token_ids)
    for step, (token, top) in enumerate(zip(sequence.token_ids, sequence.logprobs)):
        expected = reference[len(prompt) - 1 + step]
        assert abs(top[token].logprob - expected[token].item()) < 1e-4
        assert top[token].rank == 1  # greedy picks the most likely
        assert len(top) <= 6
        for token_id, logprob in top.items():
            assert abs(logprob.logprob - expected[token_id].item()) < 1e-4
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position][prompt[position]]
        assert abs(entry.logprob - reference[position - 1][prompt[position]].item()) < 1e-4
    expected_sum = sum(reference[len(prompt) - 1 + step][token].item() for step, token in enumerate(sequence.token_ids))
    assert sequence.cumulative_logprob == pytest.approx(expected_sum, abs=1e-3)
    assert llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    assert_all_blocks_free(llm)


def test_request_metrics_say_when_things_happened(llm_and_model):
    llm, _ = llm_and_model
    output = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=5, min_tokens=5), use_tqdm=False)[0]
    timing = output.metrics
    assert timing.arrival_time <= timing.first_scheduled_time <= timing.first_token_time
    assert timing.first_token_time <= timing.last_token_time <= timing.finished_time
    assert timing.time_in_queue >= 0 and timing.prefill_time >= 0 and timing.decode_time > 0


def test_seed_reproducible_whatever_the_batch(llm_and_model):
    llm, model = llm_and_model
    prompt = random_prompts(1, model.config.vocab_size, seed=2)[0]
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = random_prompts(6, model.config.vocab_size, seed=3)
    mixed_params = [SamplingParams(temperature=0.8, max_tokens=10, ignore_eos=True)] * 6 + [seeded]
    in_batch = llm.generate(others + [prompt], mixed_params, use_tqdm=False)[-1].outputs[0].token_ids
    assert alone == in_batch
    other_seed = llm.generate([prompt], SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_sequences(llm_and_model):
    llm, model = llm_and_model
    prompt = random_prompts(1, model.config.vocab_size, seed=4)[0]
    sampled = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in sampled.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) == 8 for o in sampled.outputs)
    assert len({tuple(o.token_ids) for o in sampled.outputs}) > 1
    greedy_n = llm.generate([prompt], SamplingParams(n=2, temperature=0.0, max_tokens=8, min_tokens=8), use_tqdm=False)[0]
    assert greedy_n.outputs[0].token_ids == greedy_n.outputs[1].token_ids == greedy(model, prompt, 8)


def test_repetition_penalty_matches_transformers(llm_and_model):
    llm, model = llm_and_model
    prompt = random_prompts(1, model.config.vocab_size, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, repetition_penalty=1.5)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert tokens == greedy(model, prompt, 10, repetition_penalty=1.5)


@torch.inference_mode()
def test_presence_and_frequency_penalties_follow_openai_formula(llm_and_model):
    llm, model = llm_and_model
    prompt = random_prompts(1, model.config.vocab_size, seed=6)[0]
    # Negative penalties favour repeats: a random model rarely repeats on its own, so positive
    # ones would leave greedy output unchanged and prove nothing.
    params = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, presence_penalty=-2.0, frequency_penalty=-1.5)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    expected: list[int] = []
    for _ in range(10):
        logits = model(torch.tensor([prompt + expected])).logits[0, -1].float()
        for token in set(expected):
            logits[token] -= params.frequency_penalty * expected.count(token) + params.presence_penalty
        expected.append(int(logits.argmax()))
    assert tokens == expected
    unpenalised = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10), use_tqdm=False)
    assert unpenalised[0].outputs[0].token_ids != tokens


def test_prefix_cache_hit_reported(llm_and_model):
    llm, model = llm_and_model
    prefix = random_prompts(1, model.config.vocab_size, seed=8, min_len=64, max_len=65)[0][:64]
    first = llm.generate([prefix + [5, 6, 7]], GREEDY, use_tqdm=False)[0]
    second = llm.generate([prefix + [9, 10, 11, 12]], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 64
    assert second.outputs[0].token_ids == greedy(model, prefix + [9, 10, 11, 12], 12)
    assert first.outputs[0].token_ids == greedy(model, prefix + [5, 6, 7], 12)


def test_abort_frees_blocks_at_once(llm_and_model):
    llm, model = llm_and_model
    prompt = random_prompts(1, model.config.vocab_size, seed=9)[0]
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(out=llm.generate([prompt], SamplingParams(max_tokens=1500, ignore_eos=True), use_tqdm=False))
    )
    thread.start()
    deadline = time.monotonic() + 30
    stats = llm.call_utility("kv_stats")
    while time.monotonic() < deadline and stats["num_free_blocks"] == stats["num_blocks"]:
        time.sleep(0.01)  # until the request runs: a poll, not a guess of how long that takes
        stats = llm.call_utility("kv_stats")
    assert stats["num_free_blocks"] < stats["num_blocks"], "the request should be running"
    request_id = llm._requests.all()[0].output.request_id
    llm.abort(request_id)
    thread.join(timeout=10)
    assert result["out"][0].outputs[0].finish_reason == "abort"
    assert_all_blocks_free(llm)


def test_a_request_longer_than_the_context_is_refused_as_over_http(llm_and_model):
    """fleet.LLM validates a request with the API server's function (core/validation.py): the same
    errors, raised before anything reaches the engine."""
    llm, _ = llm_and_model
    max_model_len = llm.config.model.max_model_len
    with pytest.raises(InvalidParameter, match=f"maximum context length is {max_model_len} tokens. "
                                               f"However, your prompt has {max_model_len} tokens") as refused:
        llm.generate([[5] * max_model_len], use_tqdm=False)
    assert refused.value.param == "prompt"
    with pytest.raises(InvalidParameter, match=f"you requested {max_model_len + 4} tokens") as refused:
        llm.generate([[5] * (max_model_len - 4)], SamplingParams(max_tokens=8), use_tqdm=False)
    assert refused.value.param == "max_tokens"
    assert not llm._requests
    assert_all_blocks_free(llm)
