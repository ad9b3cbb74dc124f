"""Tool calling through the openai client: tools shown to the model by its
chat template (checked against transformers' rendering), calls forced by
tool_choice "required" or a named function (structured outputs, so even a
random tiny model calls validly), and calls read from the text with
--enable-auto-tool-choice --tool-call-parser hermes. The parsers also run
alone on the formats the models write."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from fleet.core.sampling_params import InvalidParameter
from fleet.frontend.output_processor import CompletionOutput
from fleet.frontend.serving import ToolCallStream
from fleet.frontend.tool_calls import ToolChoice, hermes_content_length, parse_hermes, parse_llama3_json
from fleet.tests.frontend.server import Server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
def assert_valid_calls(calls, names=("get_weather", "get_time")) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


# ---------------------------------------------------------------- parsers and checks, no processes


def test_hermes_calls_and_the_content_around_them():
    text = 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo", "days": 2}), ("get_time", {"zone": "UTC"})]
    assert parse_hermes("no call here") == ("no call here", [])
    assert parse_hermes("<tool_call>{not json</tool_call>")[1] == []


def test_llama3_json_calls():
    content, calls = parse_llama3_json('<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}; '
                                       '{"name": "get_weather", "parameters": {"city": "Rome", "days": 1}}')
    assert content is None and [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse_llama3_json("The answer is 4.") == ("The answer is 4.", [])
    assert parse_llama3_json('{"answer": 4}') == ('{"answer": 4}', []), "JSON that is no call stays content"


def test_streamed_content_stops_where_a_call_may_start():
    assert hermes_content_length("Hello <tool") == len("Hello ")
    assert hermes_content_length("Hello <tool_call>{") == len("Hello ")
    assert hermes_content_length("a < b") == len("a < b")


def test_a_stream_pieces_together_the_replys_content_and_calls():
    tools = ToolChoice(TOOLS, "auto", "hermes", True)
    parts = ["Let me", " check.<tool", '_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
             " Done."]
    stream, sequence, content, calls = ToolCallStream(tools), CompletionOutput(0), "", []
    for index, part in enumerate(parts):
        sequence.text += part
        sequence.finish_reason = "stop" if index == len(parts) - 1 else None
        deltas, calls = stream.advance(sequence)
        assert all("<tool" not in delta.get("content", "") for delta in deltas), "no part of a call goes out as content"
        content += "".join(delta.get("content", "") for delta in deltas)
    whole_content, whole_calls = tools.parse(sequence.text)
    assert content == whole_content == "Let me check. Done."
    assert [call.name for call in calls] == [call.name for call in whole_calls] == ["get_time"]
    assert deltas[-1] == {}, "the finish reason goes out after the call, alone"
    named, arguments = [delta["tool_calls"][0] for delta in deltas if "tool_calls" in delta]
    assert named["function"] == {"name": "get_time", "arguments": ""} and named["id"] == calls[0].id
    assert arguments == {"index": 0, "function": {"arguments": calls[0].arguments}}


def test_tool_choice_checks():
    with pytest.raises(InvalidParameter, match="not in tools"):
        ToolChoice(TOOLS, {"type": "function", "function": {"name": "nope"}}, None, False)
    with pytest.raises(InvalidParameter, match="--enable-auto-tool-choice"):
        ToolChoice(TOOLS, None, None, False)  # tools without tool_choice mean "auto"
    with pytest.raises(InvalidParameter, match="needs tools"):
        ToolChoice(None, "required", "hermes", True)
    assert ToolChoice(TOOLS, "none", None, False).constraint() is None
    assert ToolChoice(None, None, None, False).choice == "none"
    single = ToolChoice(TOOLS, "auto", "hermes", True, parallel_calls=False)
    assert len(single.parse('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>' * 2)[1]) == 1
    assert single.constraint() is None and ToolChoice(TOOLS, "required", None, False, False).constraint().json[
        "maxItems"] == 1


# ---------------------------------------------------------------- a server with a tool-aware template


@pytest.fixture(scope="module")
def server(tool_model_dir):
    server = Server(tool_model_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "8M",
                    "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield server
    assert server.stop() == 0
    server.assert_nothing_left()


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client()


def ask(client, server, **fields):
    fields = {"messages": [{"role": "user", "content": "weather?"}], "max_tokens": 200, "seed": 1, **fields}
    return client.chat.completions.create(model=server.get("/v1/models").json()["data"][0]["id"], **fields)


@pytest.mark.slow
def test_tools_and_tool_history_reach_the_chat_template(client, server, tool_model_dir):
    from transformers import AutoTokenizer

    arguments = {"city": "Oslo", "days": 2}
    history = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    ]
    reply = ask(client, server, messages=history, tools=TOOLS, tool_choice="none", max_tokens=1)
    rendered = [dict(message) for message in history]
    rendered[1] = {**rendered[1], "tool_calls": [{"id": "call-1", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": arguments}}]}
    expected = AutoTokenizer.from_pretrained(tool_model_dir).apply_chat_template(
        rendered, tools=TOOLS, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert reply.usage.prompt_tokens == len(expected)
    assert reply.choices[0].message.tool_calls is None, 'tool_choice "none" reads no calls'


@pytest.mark.slow
def test_required_and_named_tool_choice_always_call_validly(client, server):
    required = ask(client, server, tools=TOOLS, tool_choice="required", n=2, temperature=1.0)
    for choice in required.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert_valid_calls(choice.message.tool_calls)
    named = ask(client, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert_valid_calls(named.choices[0].message.tool_calls, names=("get_time",))
    assert len(named.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_streamed_tool_calls_complete_before_the_finish_reason(client, server):
    """Each call's name, then its arguments, then a chunk with the finish reason alone: so the SDK's
    stream helper reports each call's arguments done. No chunk goes out empty while text is held back."""
    whole = ask(client, server, tools=TOOLS, tool_choice="required", temperature=0)
    chunks = list(ask(client, server, tools=TOOLS, tool_choice="required", temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and chunks[-1].choices[0].delta.tool_calls is None
    for chunk in chunks[1:-1]:  # the first names the role
        delta = chunk.choices[0].delta
        assert chunk.choices[0].finish_reason is None and (delta.content or delta.tool_calls), chunk
    with client.chat.completions.stream(model=server.get("/v1/models").json()["data"][0]["id"], max_tokens=200,
                                        messages=[{"role": "user", "content": "weather?"}], seed=1, temperature=0,
                                        tools=TOOLS, tool_choice="required") as stream:
        done = [(event.name, event.arguments) for event in stream
                if event.type == "tool_calls.function.arguments.done"]
    expected = [(call.function.name, call.function.arguments) for call in whole.choices[0].message.tool_calls]
    assert done == expected
    assert_valid_calls(whole.choices[0].message.tool_calls)


@pytest.mark.slow
def test_max_completion_tokens_wins_over_max_tokens(client, server):
    reply = ask(client, server, max_tokens=50, max_completion_tokens=3, extra_body={"min_tokens": 3})
    assert reply.usage.completion_tokens == 3


@pytest.mark.slow
def test_auto_tool_choice_reads_hermes_calls_from_the_text(client, server):
    """The tiny model is made to write a Hermes call (a regex constraint on its
    text), which the hermes parser must find, streamed or not."""
    written = r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,8}", "days": [1-7]\}\}</tool_call>'
    fields = {"tools": TOOLS, "tool_choice": "auto", "extra_body": {"structured_outputs": {"regex": written}}}
    reply = ask(client, server, **fields).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content == "Sure."
    assert_valid_calls(reply.message.tool_calls, names=("get_weather",))
    content = "".join(chunk.choices[0].delta.content or "" for chunk in ask(client, server, stream=True, **fields))
    assert content == "Sure." and "<tool_call>" not in content
    with client.chat.completions.stream(model=server.get("/v1/models").json()["data"][0]["id"], max_tokens=200,
                                        messages=[{"role": "user", "content": "weather?"}], seed=1, **fields) as stream:
        streamed = stream.get_final_completion().choices[0].message
    assert streamed.content == "Sure."
    assert_valid_calls(streamed.tool_calls, names=("get_weather",))
    plain = ask(client, server, tools=TOOLS, max_tokens=20).choices[0]
    assert plain.message.tool_calls is None and plain.message.content, "text without a call is content"


@pytest.mark.slow
def test_bad_tool_choices_are_400s(client, server):
    with pytest.raises(openai.BadRequestError) as unknown:
        ask(client, server, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert unknown.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as both:
        ask(client, server, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"})
    assert both.value.body["param"] == "tool_choice"
    assert server.get("/health").status_code == 200


@pytest.mark.slow
def test_auto_tool_choice_needs_the_servers_flags(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M")
    try:
        client = server.openai_client()
        with pytest.raises(openai.BadRequestError) as auto:
            ask(client, server, tools=TOOLS)
        assert "--enable-auto-tool-choice" in auto.value.body["message"]
    finally:
        server.close()
    server.assert_nothing_left()
