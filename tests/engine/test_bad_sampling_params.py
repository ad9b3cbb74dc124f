"""A request whose sampling parameters make the worker's sampler raise (it got
past the front ends' validation, or came from a client that skipped it) fails
alone with an error; the worker and the engine serve the rest of the batch
and later requests exactly as before."""
from __future__ import annotations

import time

import pytest

from fleet.config import EngineArgs
from fleet.core.engine_core import EngineCore
from fleet.core.launch.engine_process import build_engine_core
from fleet.core.launch.node_plan import engine_core_plans
from fleet.core.messages import EngineCoreOutput, EngineCoreRequest
from fleet.core.sampling_params import SamplingParams
from fleet.tests.engine.oracle import greedy, hf_model

GOOD = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
PROMPTS = [[5, 17, 42, 99, 7], [8, 9, 10]]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    """The engine core with its worker in this process (the `uni` executor): the real sampler."""
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory_bytes="4M",
                        distributed_executor_backend="uni").create_config()
    return build_engine_core(config, engine_core_plans(config, [0], clients=[], coordinator=None)[0])


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, EngineCoreOutput]:
    """Add the requests and step until all finished; each one's tokens gathered into its final output."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(EngineCoreRequest(request_id, prompt, params, time.time()))
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    finished: dict[str, EngineCoreOutput] = {}
    while engine.has_work():
        for outputs in engine.step().values():
            for output in outputs.outputs:
                tokens[output.request_id] += output.new_token_ids
                if output.finish_reason is not None:
                    finished[output.request_id] = output
    for request_id, output in finished.items():
        output.new_token_ids = tokens[request_id]
    return finished


@pytest.mark.parametrize("bad", [
    SamplingParams(temperature=0.0, max_tokens=4, logit_bias={100_000: 5.0}),
    SamplingParams(temperature=0.0, max_tokens=4, logit_bias={-100_000: 5.0}),
    SamplingParams(temperature=0.8, max_tokens=4, min_tokens=2, stop_token_ids=[1_000_000_000]),
])
def test_only_the_bad_request_fails(engine, tiny_llama_dir, bad):
    finished = run(engine, {"good-0": (PROMPTS[0], GOOD), "bad": ([3, 4, 5], bad), "good-1": (PROMPTS[1], GOOD)})
    assert finished["bad"].finish_reason == "error"
    assert "sampling failed" in finished["bad"].error
    oracle = hf_model(tiny_llama_dir)
    for index, prompt in enumerate(PROMPTS):
        assert finished[f"good-{index}"].finish_reason == "length"
        assert finished[f"good-{index}"].new_token_ids == greedy(oracle, prompt, 6)
    stats = engine.utility("kv_stats", [])
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_the_engine_serves_on_after_a_failed_request(engine, tiny_llama_dir):
    run(engine, {"bad": ([3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4, logit_bias={10**6: 1.0}))})
    finished = run(engine, {"after": (PROMPTS[0], GOOD)})
    assert finished["after"].new_token_ids == greedy(hf_model(tiny_llama_dir), PROMPTS[0], 6)
