"""OpenAI's Responses API through the openai SDK against a real launch of two
API servers: texts compared with transformers' greedy continuation of the
conversation the request describes (its chat template rendered by
transformers), tools, structured output, streaming assembled by the SDK's
helpers, stored responses on either API server, background runs."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field
from transformers import AutoTokenizer

from fleet.tests.engine.oracle import hf_model
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}
MAX_STORED = 4


@pytest.fixture(scope="module")
def server(tool_model_dir):
    server = Server(tool_model_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "8M",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--api-server-count", "2",
                    "--max-stored-responses", str(MAX_STORED))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return server.openai_client()


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


def oracle(model_dir: str, messages: list[dict], max_tokens: int) -> tuple[str, int, int]:
    """transformers' greedy reply to `messages`, stopping at EOS: (text, prompt tokens, reply tokens)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    with torch.inference_mode():
        out = hf_model(model_dir).generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                                           max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    reply = out[0, len(prompt):].tolist()
    # A reply cut inside a UTF-8 character: its text holds back the incomplete end (/detokenize shows U+FFFD).
    return tokenizer.decode(reply, skip_special_tokens=True).rstrip("\ufffd"), len(prompt), len(reply)


def assert_matches_oracle(response, model_dir: str, messages: list[dict], max_tokens: int) -> None:
    text, prompt_tokens, reply_tokens = oracle(model_dir, messages, max_tokens)
    assert response.output_text == text
    assert (response.usage.input_tokens, response.usage.output_tokens) == (prompt_tokens, reply_tokens)
    assert response.status == ("incomplete" if reply_tokens == max_tokens else "completed")


def test_plain_and_with_instructions(client, model, tool_model_dir):
    plain = client.responses.create(model=model, input="Say hi", max_output_tokens=8, temperature=0)
    assert plain.object == "response" and plain.id.startswith("resp_") and plain.model == model
    assert [item.type for item in plain.output] == ["message"] and plain.output[0].role == "assistant"
    assert_matches_oracle(plain, tool_model_dir, [{"role": "user", "content": "Say hi"}], 8)
    briefed = client.responses.create(model=model, instructions="Answer in French.", max_output_tokens=8,
                                      input=[{"role": "user", "content": [{"type": "input_text", "text": "Say hi"}]}],
                                      temperature=0, metadata={"run": "1"})
    assert briefed.instructions == "Answer in French." and briefed.metadata == {"run": "1"}
    assert_matches_oracle(briefed, tool_model_dir, [{"role": "system", "content": "Answer in French."},
                                                    {"role": "user", "content": "Say hi"}], 8)


def test_stream_assembles_into_the_same_response(client, model):
    whole = client.responses.create(model=model, input="Tell me a story", max_output_tokens=16, temperature=0)
    with client.responses.stream(model=model, input="Tell me a story", max_output_tokens=16, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.usage.output_tokens == whole.usage.output_tokens
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.status == whole.status
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas and "".join(deltas) == whole.output_text
    assert [event.sequence_number for event in events] == list(range(len(events)))


class Forecast(BaseModel):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


def test_parse_with_a_pydantic_text_format(client, model):
    parsed = client.responses.parse(model=model, input="Weather in Oslo?", text_format=Forecast,
                                    max_output_tokens=100, temperature=0)
    assert isinstance(parsed.output_parsed, Forecast)
    assert parsed.output_parsed == Forecast.model_validate_json(parsed.output_text)
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    raw = client.responses.create(model=model, input="Weather in Oslo?", max_output_tokens=100, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "flag", "schema": flag}})
    assert raw.text.format.type == "json_schema" and isinstance(json.loads(raw.output_text)["ok"], bool)
    any_object = client.responses.create(model=model, input="Weather in Oslo?", max_output_tokens=8,
                                         text={"format": {"type": "json_object"}}, temperature=0)
    assert any_object.output_text.startswith("{")  # a random model's object may not end within 8 tokens


def test_a_function_call_and_its_output_fed_back(client, model, tool_model_dir):
    question = "What is the weather in Oslo?"
    called = client.responses.create(model=model, input=question, tools=[WEATHER_TOOL], tool_choice="required",
                                     max_output_tokens=100, temperature=0)
    calls = [item for item in called.output if item.type == "function_call"]
    assert calls and {item.type for item in called.output} == {"function_call"}
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER)
    answered = client.responses.create(
        model=model, previous_response_id=called.id, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"} for call in calls])
    assert answered.previous_response_id == called.id
    history = [{"role": "user", "content": question},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": call.call_id, "type": "function",
                    "function": {"name": call.name, "arguments": json.loads(call.arguments)}} for call in calls]}]
    history += [{"role": "tool", "tool_call_id": call.call_id, "content": "sunny"} for call in calls]
    assert_matches_oracle(answered, tool_model_dir, history, 8)

    named = client.responses.create(model=model, input=question, tools=[WEATHER_TOOL], max_output_tokens=100,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather"
    with client.responses.stream(model=model, input=question, tools=[WEATHER_TOOL], tool_choice="required",
                                 max_output_tokens=100, temperature=0) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert [(c.name, c.arguments) for c in streamed.output] == [(c.name, c.arguments) for c in calls]


def test_a_conversation_through_previous_response_id(client, model, tool_model_dir):
    first = client.responses.create(model=model, input="Hello there", max_output_tokens=6, temperature=0)
    second = client.responses.create(model=model, previous_response_id=first.id, input="And then?",
                                     instructions="Be brief.", max_output_tokens=6, temperature=0)
    assert_matches_oracle(second, tool_model_dir, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And then?"}], 6)


def test_a_stored_response_from_either_api_server_then_deleted(server, client, model):
    created = client.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    answered_by = set()
    for _ in range(60):  # each request on a new connection: either API server may take it
        reply = httpx.get(f"{server.base_url}/responses/{created.id}", timeout=30)
        assert reply.status_code == 200 and reply.json()["output"] == created.model_dump(exclude_none=True)["output"]
        answered_by.add(reply.headers["fleet-api-server"])
        if len(answered_by) == 2:
            break
    assert answered_by == {"0", "1"}, "one API server answered for the other's response"
    assert client.responses.retrieve(created.id).output_text == created.output_text
    (item,) = client.responses.input_items.list(created.id).data
    assert item.type == "message" and item.content[0].text == "Hi"
    assert client.responses.delete(created.id) is None
    for _ in range(4):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(created.id)
    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_the_store_keeps_the_newest(server, model):
    with httpx.Client(base_url=server.base_url, timeout=60) as one_server:  # one connection: one API server
        body = {"model": model, "input": "Hi", "max_output_tokens": 2}
        ids = [one_server.post("/responses", json=body).json()["id"] for _ in range(MAX_STORED + 2)]
        assert [one_server.get(f"/responses/{i}").status_code for i in ids] == [404] * 2 + [200] * MAX_STORED


LONG_JSON = {"type": "object", "properties": {"s": {"type": "string", "minLength": 1500}}, "required": ["s"],
             "additionalProperties": False}
"""Output of at least 1,500 tokens, whatever the random model prefers."""


def wait_for_status(client: openai.OpenAI, response_id: str, statuses: set[str], timeout: float = 60):
    deadline = time.monotonic() + timeout
    while (response := client.responses.retrieve(response_id)).status not in statuses:
        assert time.monotonic() < deadline, response.status
        time.sleep(0.05)
    return response


def test_background_responses_run_and_cancel(server, client, model):
    background = client.responses.create(model=model, input="Hi", max_output_tokens=6, temperature=0,
                                         background=True)
    assert background.status == "queued" and background.background
    done = wait_for_status(client, background.id, {"completed", "incomplete"})
    foreground = client.responses.create(model=model, input="Hi", max_output_tokens=6, temperature=0)
    assert done.output_text == foreground.output_text
    long = client.responses.create(model=model, input="Hi", max_output_tokens=1900, background=True,
                                   text={"format": {"type": "json_schema", "name": "long", "schema": LONG_JSON}})
    wait_for_status(client, long.id, {"in_progress"})
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert server.wait_until(lambda: server.metric("fleet:num_requests_running") == 0, timeout=10), \
        "the cancelled response still runs in the engine"
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(foreground.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.cancel("resp_nosuchresponse_0")


@pytest.mark.parametrize("body, param", [
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "mystery"}]}, "tools[0]"),
    ({"input": "hi", "tools": [WEATHER_TOOL], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input[0].content"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0]"),
    ({"input": "hi", "previous_response_id": "resp_unknown_0"}, "previous_response_id"),
    ({"input": "hi", "background": True, "store": False}, "background"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"input": "hi", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({}, "input"),
])
def test_bad_requests_are_400s_naming_the_field(server, model, body, param):
    reply = server.post("/v1/responses", json={"model": model, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error


def test_unknown_ids_and_models_are_404s(server, model):
    for path in ("/v1/responses/resp_nope_0", "/v1/responses/nonsense", "/v1/responses/resp_nope_0/input_items"):
        assert server.get(path).json()["error"]["code"] == 404
    assert httpx.delete(f"{server.url}/v1/responses/resp_nope_0").status_code == 404
    reply = server.post("/v1/responses", json={"model": "gpt-9", "input": "hi"})
    assert reply.status_code == 404 and reply.json()["error"]["param"] == "model"
