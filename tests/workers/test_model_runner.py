"""ModelRunner and Worker in this process on the CPU, on the tiny Llama:
steps built by hand as a scheduler sends them, outputs compared with
transformers."""
from __future__ import annotations

import pytest
import torch

from fleet.config import EngineArgs
from fleet.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from fleet.core.launch.node_plan import replica_workers
from fleet.core.sampling_params import SamplingParams
from fleet.tests.engine.oracle import greedy, hf_model, log_softmax
from fleet.workers.loader import load_model
from fleet.workers.model_runner import ModelRunner

BLOCK_SIZE = 16
NUM_BLOCKS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, min_tokens=4)
PROMPT = [5, 17, 42, 99, 3, 250, 8, 61, 77, 140, 33]


def engine_config(model_dir: str):
    return EngineArgs(model=model_dir, dtype="float32", device="cpu", kv_cache_memory_bytes="4M",
                      block_size=BLOCK_SIZE, distributed_executor_backend="uni").create_config()


@pytest.fixture(scope="module")
def runner(tiny_llama_dir) -> ModelRunner:
    config = engine_config(tiny_llama_dir)
    model = load_model(config.model, config.load, torch.float32, torch.device("cpu"))
    runner = ModelRunner(config, model, torch.device("cpu"))
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


def step(step_id: int, scheduled: dict[str, int], new_requests=(), cached=(), finished=()) -> SchedulerOutput:
    return SchedulerOutput(step_id, list(new_requests), list(cached), scheduled, list(finished))


def decode(runner: ModelRunner, step_id: int, request_id: str, token: int, computed: int) -> list[int]:
    output = runner.execute(step(step_id, {request_id: 1}, cached=[CachedRequestData(request_id, [token], [],
                                                                                    computed)]))
    assert output.request_ids == [request_id]
    return output.sampled_token_ids[0]


def test_chunked_prefill_then_decodes_match_transformers(runner, tiny_llama_dir):
    expected = greedy(hf_model(tiny_llama_dir), PROMPT, 4)
    first_chunk = step(1, {"a": 6}, new_requests=[NewRequestData("a", PROMPT, GREEDY, [0], 0)])
    assert runner.execute(first_chunk).request_ids == []  # mid-prompt: nothing sampled
    output = runner.execute(step(2, {"a": 5}, cached=[CachedRequestData("a", [], [], 6)]))
    assert output.step_id == 2 and output.request_ids == ["a"]
    tokens = output.sampled_token_ids[0]
    for step_id, computed in enumerate(range(len(PROMPT), len(PROMPT) + 3), start=3):
        tokens += decode(runner, step_id, "a", tokens[-1], computed)
    assert tokens == expected
    runner.execute(step(6, {}, finished=["a"]))
    assert not runner.states.states and len(runner.states.rows) == 0


def test_a_decode_and_a_new_prompt_in_one_step_match_transformers(runner, tiny_llama_dir):
    model = hf_model(tiny_llama_dir)
    other = [9, 8, 7, 6, 5, 4, 3, 200, 300, 400]
    output = runner.execute(step(1, {"a": len(PROMPT)}, new_requests=[NewRequestData("a", PROMPT, GREEDY, [1], 0)]))
    first = output.sampled_token_ids[0]
    # a decodes beside b's whole prompt (in blocks after a's): decodes first, as the scheduler orders them
    output = runner.execute(step(2, {"a": 1, "b": len(other)},
                                 new_requests=[NewRequestData("b", other, GREEDY, [2, 3], 0)],
                                 cached=[CachedRequestData("a", first, [], len(PROMPT))]))
    assert output.request_ids == ["a", "b"]
    assert first + output.sampled_token_ids[0] == greedy(model, PROMPT, 2)
    assert output.sampled_token_ids[1] == greedy(model, other, 1)
    runner.execute(step(3, {}, finished=["a", "b"]))


def test_prompt_logprobs_match_log_softmax(runner, tiny_llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    chunks = [step(1, {"a": 7}, new_requests=[NewRequestData("a", PROMPT, params, [4], 0)]),
              step(2, {"a": 4}, cached=[CachedRequestData("a", [], [], 7)])]
    logprobs = [entry for chunk in chunks for entry in runner.execute(chunk).prompt_logprobs["a"]]
    reference = log_softmax(hf_model(tiny_llama_dir), PROMPT)
    assert len(logprobs) == len(PROMPT) - 1  # position 0 has none
    for position, entry in enumerate(logprobs, start=1):
        assert entry.token_ids[0] == PROMPT[position]
        assert entry.logprobs[0] == pytest.approx(reference[position - 1][PROMPT[position]].item(), abs=1e-4)
        assert len(entry.token_ids) <= 3
    runner.execute(step(3, {}, finished=["a"]))


def test_mean_pooling_over_chunks_matches_transformers_hidden_states(runner, tiny_llama_dir):
    from transformers import AutoModel

    request = NewRequestData("e", PROMPT, SamplingParams(max_tokens=1), [5], 0, pooling="mean")
    assert runner.execute(step(1, {"e": 5}, new_requests=[request])).embeddings == {}
    output = runner.execute(step(2, {"e": 6}, cached=[CachedRequestData("e", [], [], 5)]))
    assert output.request_ids == []  # an embedding request samples nothing
    with torch.inference_mode():
        hidden = AutoModel.from_pretrained(tiny_llama_dir, dtype=torch.float32)(torch.tensor([PROMPT]))
    expected = torch.nn.functional.normalize(hidden.last_hidden_state[0].mean(dim=0), dim=0)
    assert torch.allclose(torch.tensor(output.embeddings["e"]), expected, atol=1e-4)
    runner.execute(step(3, {}, finished=["e"]))


def test_a_step_with_nothing_scheduled_returns_an_empty_output(runner):
    output = runner.execute(step(9, {}))
    assert output.step_id == 9 and output.request_ids == [] and output.sampled_token_ids == []


def test_a_worker_in_this_process_serves_a_request(tiny_llama_dir):
    from fleet.core.launch.worker_process import build_worker

    config = engine_config(tiny_llama_dir)
    threads = torch.get_num_threads()
    try:
        worker = build_worker(config, replica_workers(config, 0)[0], store=None)
    finally:
        torch.set_num_threads(threads)  # the worker takes the cores it is given
    num_blocks = worker.available_kv_blocks()
    assert num_blocks == 4 * 2**20 // worker.runner.kv_bytes_per_block()
    worker.init_kv_cache(num_blocks)
    output = worker.execute(step(1, {"a": len(PROMPT)}, new_requests=[NewRequestData("a", PROMPT, GREEDY, [0], 0)]))
    assert output.sampled_token_ids == [greedy(hf_model(tiny_llama_dir), PROMPT, 1)]
    assert worker.execute(step(2, {}, finished=["a"])).request_ids == []
