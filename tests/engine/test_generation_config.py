"""The model's generation_config.json as a user meets it: its sampling
defaults fill what a request leaves unset (--generation-config auto, as in
vLLM), and every eos id it lists ends generation. The model is a copy of the
tiny Llama with a generation_config.json that adds a second eos id; served by
fleet.LLM and over HTTP, with transformers' greedy tokens as the oracle."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import fleet
from fleet import SamplingParams
from fleet.config import EngineArgs
from fleet.tests.engine.helpers import assert_no_fleet_processes
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.tests.frontend.server import Server

PROMPT = [5, 17, 42, 99, 7, 23, 64]
PRIMARY_EOS = 2
TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M")
DEFAULTS = {"top_k": 1, "temperature": 0.8, "max_new_tokens": 6}
"""top_k 1 makes a request without sampling fields greedy, whatever its temperature."""


class GenerationModel:
    def __init__(self, path: str, expected: list[int], stop_at: int):
        self.path = path
        self.expected = expected
        """transformers' 12 greedy tokens after PROMPT (no eos masking beyond the primary one)."""
        self.stop_at = stop_at
        """Index in `expected` of the token the generation config adds as a second eos id."""


@pytest.fixture(scope="module")
def generation_model(tiny_llama_dir, tmp_path_factory) -> GenerationModel:
    expected = greedy(hf_model(str(tiny_llama_dir)), PROMPT, 12)
    stop_at = next(i for i in range(2, 5) if expected[i] not in expected[:i])
    assert PRIMARY_EOS not in expected, "pick another PROMPT: the primary eos would end it first"
    path = tmp_path_factory.mktemp("tiny-llama-generation-config")
    for item in Path(tiny_llama_dir).iterdir():
        if item.name != "generation_config.json":
            (path / item.name).symlink_to(item)
    generation = {"eos_token_id": [PRIMARY_EOS, expected[stop_at]], **DEFAULTS}
    (path / "generation_config.json").write_text(json.dumps(generation))
    return GenerationModel(str(path), expected, stop_at)


def test_generation_config_resolves_to_defaults_and_every_eos_id(generation_model):
    auto = EngineArgs(model=generation_model.path, device="cpu").create_config().model
    second_eos = generation_model.expected[generation_model.stop_at]
    assert auto.eos_token_ids == [PRIMARY_EOS, second_eos]
    assert auto.sampling_defaults == {"temperature": 0.8, "top_k": 1, "max_tokens": 6}
    own = EngineArgs(model=generation_model.path, device="cpu", generation_config="vllm").create_config().model
    assert own.sampling_defaults == {} and own.eos_token_ids == [PRIMARY_EOS, second_eos], "eos ids are the model's"
    elsewhere = EngineArgs(model=generation_model.path, device="cpu", generation_config=generation_model.path)
    assert elsewhere.create_config().model.sampling_defaults == auto.sampling_defaults


def test_a_generation_config_that_is_not_there_names_the_flag(generation_model, tmp_path):
    with pytest.raises(ValueError, match=r"--generation-config .*auto, vllm or a directory"):
        EngineArgs(model=generation_model.path, device="cpu", generation_config=str(tmp_path)).create_config()


@pytest.mark.slow
def test_llm_applies_the_defaults_and_stops_at_the_second_eos(generation_model):
    llm = fleet.LLM(generation_model.path, dtype="float32", device="cpu", kv_cache_memory_bytes="4M")
    try:
        expected, stop_at = generation_model.expected, generation_model.stop_at
        assert llm.get_default_sampling_params() == SamplingParams(temperature=0.8, top_k=1, max_tokens=6)
        by_default = llm.generate([PROMPT], use_tqdm=False)[0].outputs[0]
        assert by_default.token_ids == expected[: stop_at + 1] and by_default.finish_reason == "stop"
        past_eos = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                use_tqdm=False)[0].outputs[0]
        assert past_eos.token_ids == expected and past_eos.finish_reason == "length"
    finally:
        llm.shutdown()
    assert_no_fleet_processes()


@pytest.mark.slow
def test_http_requests_take_the_defaults_they_leave_unset(generation_model):
    server = Server(generation_model.path, *TINY)
    try:
        expected, stop_at = generation_model.expected, generation_model.stop_at
        body = {"model": generation_model.path, "prompt": PROMPT, "ignore_eos": True}
        unset = server.post("/v1/completions", json=body).json()
        assert unset["choices"][0]["finish_reason"] == "length"
        assert unset["usage"]["completion_tokens"] == 6, "max_new_tokens caps a request without max_tokens"
        # An incomplete UTF-8 character at the end: the server holds it back, /detokenize shows U+FFFD.
        greedy_text = server.post("/detokenize", json={"tokens": expected}).json()["prompt"].rstrip("\ufffd")
        assert _text(server, {**body, "max_tokens": 12}) == greedy_text, "top_k 1 from the generation config"
        stopped = server.post("/v1/completions", json={**body, "ignore_eos": False, "max_tokens": 12}).json()
        assert stopped["choices"][0]["finish_reason"] == "stop"
        assert stopped["usage"]["completion_tokens"] == stop_at + 1, "the second eos id ended it"
        sampled = {_text(server, {**body, "max_tokens": 12, "top_k": 0, "seed": seed}) for seed in range(4)}
        assert len(sampled) > 1, "a request's own top_k wins over the default (and temperature 0.8 samples)"
    finally:
        server.close()
    server.assert_nothing_left()


def _text(server: Server, body: dict) -> str:
    return server.post("/v1/completions", json=body).json()["choices"][0]["text"]
