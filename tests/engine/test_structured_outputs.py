"""Structured outputs as users ask for them: `SamplingParams(structured_outputs=...)`
offline, and over HTTP OpenAI's `response_format` and vLLM's
`structured_outputs` / `guided_*` fields. Every output of a constrained
request must parse and validate (jsonschema for JSON), on the real default
model and on a tiny random one, whose unconstrained text would never fit."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

import fleet
from fleet import SamplingParams, StructuredOutputsParams
from fleet.core.sampling_params import InvalidParameter
from fleet.tests.engine.helpers import assert_no_fleet_processes
from fleet.tests.frontend.server import Server

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{3,8}-[0-9]{2}"
CHOICE = ["alpha", "beta", "gamma"]
GBNF = 'root ::= ("yes" | "no") " " [0-9] [0-9]'
GBNF_MATCH = r"(yes|no) [0-9][0-9]"


def assert_valid_json(text: str, schema: dict = SCHEMA) -> None:
    jsonschema.validate(json.loads(text), schema)


# ---------------------------------------------------------------- parameters, no processes


def test_exactly_one_constraint_and_a_valid_one():
    StructuredOutputsParams(json=SCHEMA).validate()
    StructuredOutputsParams(json=json.dumps(SCHEMA)).validate()
    StructuredOutputsParams(json_object=True).validate()
    with pytest.raises(InvalidParameter, match="exactly one"):
        StructuredOutputsParams(regex=REGEX, choice=CHOICE).validate()
    with pytest.raises(InvalidParameter, match="exactly one"):
        StructuredOutputsParams().validate()
    with pytest.raises(InvalidParameter, match="unclosed group"):
        StructuredOutputsParams(regex="a(b").validate()
    with pytest.raises(InvalidParameter, match="choice"):
        StructuredOutputsParams(choice=[]).validate()
    with pytest.raises(InvalidParameter, match="json"):
        StructuredOutputsParams(json="{not json").validate()
    with pytest.raises(InvalidParameter) as bad_grammar:
        StructuredOutputsParams(grammar="root ::= (").validate()
    assert bad_grammar.value.param == "structured_outputs"


# ---------------------------------------------------------------- the default model, offline


@pytest.mark.slow
def test_the_default_model_answers_in_every_constrained_form():
    with fleet.LLM(kv_cache_memory_bytes="64M", max_model_len=1024) as llm:
        def answer(question: str, **constraint) -> list[str]:
            constrained = StructuredOutputsParams(**constraint)
            params = SamplingParams(temperature=0, max_tokens=120, structured_outputs=constrained)
            output = llm.chat([{"role": "user", "content": question}], params, use_tqdm=False)[0]
            return [sequence.text for sequence in output.outputs]

        (person,) = answer("Describe a person called Ada as JSON.", json=SCHEMA)
        assert_valid_json(person)
        # Any object: nothing bounds its length, so the prompt asks for a short one.
        (anything,) = answer('Reply with exactly this JSON object: {"city": "Paris", "country": "France"}',
                             json_object=True)
        assert isinstance(json.loads(anything), dict)
        (code,) = answer("Make up a product code.", regex=REGEX)
        assert re.fullmatch(REGEX, code)
        (pick,) = answer("Pick a Greek letter.", choice=CHOICE)
        assert pick in CHOICE
        (said,) = answer("Yes or no, and a number?", grammar=GBNF)
        assert re.fullmatch(GBNF_MATCH, said)
        sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=120,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
        people = llm.chat([{"role": "user", "content": "A person as JSON."}], sampled, use_tqdm=False)[0].outputs
        for sequence in people:
            assert_valid_json(sequence.text)
    assert_no_fleet_processes()


@pytest.mark.slow
def test_tensor_and_pipeline_parallel_workers_constrain(tiny_llama_dir):
    """Only the driver (tensor rank 0 of the last stage) samples, so only it holds grammars."""
    with fleet.LLM(str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_memory_bytes="4M",
                   tensor_parallel_size=2, pipeline_parallel_size=2) as llm:
        params = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=200,
                                structured_outputs=StructuredOutputsParams(json=SCHEMA))
        for sequence in llm.generate([list(range(5, 40))], params, use_tqdm=False)[0].outputs:
            assert_valid_json(sequence.text)
    assert_no_fleet_processes()


# ---------------------------------------------------------------- a tiny model over HTTP


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "16M")
    yield server
    assert server.stop() == 0
    server.assert_nothing_left()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def chat(client, server, **fields) -> openai.types.chat.ChatCompletion:
    fields = {"max_tokens": 200, "seed": 1, **fields}
    return client.chat.completions.create(
        model=server.get("/v1/models").json()["data"][0]["id"], messages=[{"role": "user", "content": "hello"}],
        **fields,
    )


@pytest.mark.slow
def test_response_format_json_schema_and_json_object(client, server):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
    completion = chat(client, server, response_format=schema_format, n=3)
    for choice in completion.choices:
        assert choice.finish_reason == "stop", "the grammar ended it, not max_tokens"
        assert_valid_json(choice.message.content)
    anything = chat(client, server, response_format={"type": "json_object"}, extra_body={"top_k": 20})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    plain = chat(client, server, response_format={"type": "text"}, max_tokens=20)
    assert plain.choices[0].message.content  # unconstrained, as without response_format


@pytest.mark.slow
def test_vllm_fields_constrain_completions_and_chat(client, server):
    model = server.get("/v1/models").json()["data"][0]["id"]
    regex = client.completions.create(model=model, prompt="code:", max_tokens=50, seed=2,
                                      extra_body={"structured_outputs": {"regex": REGEX}})
    assert re.fullmatch(REGEX, regex.choices[0].text)
    picked = chat(client, server, extra_body={"structured_outputs": {"choice": CHOICE}}).choices[0].message.content
    assert picked in CHOICE
    assert chat(client, server, extra_body={"guided_choice": CHOICE}).choices[0].message.content in CHOICE
    said = chat(client, server, extra_body={"structured_outputs": {"grammar": GBNF}}).choices[0].message.content
    assert re.fullmatch(GBNF_MATCH, said)
    assert_valid_json(chat(client, server, extra_body={"guided_json": SCHEMA}).choices[0].message.content)


@pytest.mark.slow
def test_a_streamed_constrained_answer_validates_whole(client, server):
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    stream = client.chat.completions.create(
        model=server.get("/v1/models").json()["data"][0]["id"], messages=[{"role": "user", "content": "hi"}],
        max_tokens=200, seed=3, stream=True, response_format=schema_format,
    )
    assert_valid_json("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))


@pytest.mark.slow
def test_ignore_eos_runs_a_complete_grammar_to_max_tokens(client, server):
    """Once the grammar is complete only EOS may follow; ignore_eos keeps
    sampling it until max_tokens, and the text stays the grammar's."""
    completion = chat(client, server, max_tokens=12, extra_body={"structured_outputs": {"choice": CHOICE},
                                                                 "ignore_eos": True})
    (choice,) = completion.choices
    assert choice.message.content in CHOICE
    assert choice.finish_reason == "length" and completion.usage.completion_tokens == 12


@pytest.mark.slow
def test_bad_constraints_are_a_400_naming_the_field(client, server):
    with pytest.raises(openai.BadRequestError) as bad_regex:
        chat(client, server, extra_body={"structured_outputs": {"regex": "a(b"}})
    assert bad_regex.value.body["param"] == "structured_outputs" and "unclosed group" in bad_regex.value.body["message"]
    with pytest.raises(openai.BadRequestError) as two:
        chat(client, server, response_format={"type": "json_object"}, extra_body={"guided_choice": CHOICE})
    assert "one" in two.value.body["message"]
    with pytest.raises(openai.BadRequestError) as no_schema:
        chat(client, server, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert no_schema.value.body["param"] == "response_format"
    assert server.get("/health").status_code == 200, "nothing a client sends ends the server"


@pytest.mark.slow
def test_constraints_survive_preemption_on_two_replicas(tiny_llama_dir):
    """Two replicas, each with a KV cache of 20 blocks (320 tokens), for 8
    completions of one prompt (its blocks cached and shared): some are
    preempted and come back, their grammar replayed from their tokens."""
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
                    "--kv-cache-memory-bytes", str(20 * 16 * 1024), "--dp", "2")
    try:
        client = server.openai_client()
        model = server.get("/v1/models").json()["data"][0]["id"]
        prompt = list(range(5, 65))
        completion = client.completions.create(
            model=model, prompt=prompt, n=8, max_tokens=150, seed=4, extra_body={"guided_json": SCHEMA},
        )
        for choice in completion.choices:
            assert_valid_json(choice.text)
        assert server.metric("fleet:num_preemptions_total") > 0, "the cache was small enough to preempt"
    finally:
        server.close()
    server.assert_nothing_left()

