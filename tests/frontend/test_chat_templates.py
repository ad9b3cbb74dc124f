"""Chat templates as users set them: --chat-template (a file or the template
itself), a request's own chat_template (--trust-request-chat-template), and continue_final_message, over
HTTP and in fleet.LLM. transformers' apply_chat_template on the same
conversation is the oracle for the prompt tokens."""
from __future__ import annotations

import openai
import pytest
from transformers import AutoTokenizer

import fleet
from fleet import SamplingParams
from fleet.config import EngineArgs
from fleet.tests.engine.helpers import assert_no_fleet_processes
from fleet.tests.frontend.server import Server

TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] | upper }}] {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[ASSISTANT] {% endif %}"
)
"""Not the tiny model's own template: a launch with it renders other tokens."""
STORY = [{"role": "user", "content": "tell me a story"}, {"role": "assistant", "content": "Once upon a"}]


def oracle_tokens(model_dir: str, messages, template: str | None = None, **flags) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False, **flags)


def test_chat_template_flag_takes_a_file_or_the_template(tmp_path, tiny_llama_dir):
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    from_file = EngineArgs(model=tiny_llama_dir, device="cpu", chat_template=str(path)).create_config()
    inline = EngineArgs(model=tiny_llama_dir, device="cpu", chat_template=TEMPLATE).create_config()
    assert from_file.frontend.chat_template == inline.frontend.chat_template == TEMPLATE
    with pytest.raises(ValueError, match="--chat-template 'no-such-file'"):
        EngineArgs(model=tiny_llama_dir, device="cpu", chat_template="no-such-file").create_config()


@pytest.mark.slow
def test_llm_chat_takes_a_template_and_continues_a_message(tiny_llama_dir):
    with fleet.LLM(tiny_llama_dir, dtype="float32", device="cpu", kv_cache_memory_bytes="4M") as llm:
        params = SamplingParams(temperature=0, max_tokens=3)
        own = llm.chat(STORY[:1], params, use_tqdm=False, chat_template=TEMPLATE)[0]
        assert own.prompt_token_ids == oracle_tokens(tiny_llama_dir, STORY[:1], TEMPLATE, add_generation_prompt=True)
        going_on = llm.chat(STORY, params, use_tqdm=False, add_generation_prompt=False, continue_final_message=True)[0]
        assert going_on.prompt_token_ids == oracle_tokens(tiny_llama_dir, STORY, continue_final_message=True)
    assert_no_fleet_processes()


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "template.jinja"
    path.write_text(TEMPLATE)
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--chat-template", str(path), "--trust-request-chat-template")
    yield server
    assert server.stop() == 0
    server.assert_nothing_left()


def chat(server: Server, **fields) -> dict:
    body = {"model": server.get("/v1/models").json()["data"][0]["id"], "max_tokens": 4, "min_tokens": 4, **fields}
    return server.post("/v1/chat/completions", json=body).json()


@pytest.mark.slow
def test_the_servers_template_and_a_requests_own(server, tiny_llama_dir):
    messages = STORY[:1]
    reply = chat(server, messages=messages)
    assert reply["usage"]["prompt_tokens"] == len(oracle_tokens(tiny_llama_dir, messages, TEMPLATE,
                                                                add_generation_prompt=True))
    assert reply["usage"]["prompt_tokens"] != len(oracle_tokens(tiny_llama_dir, messages, add_generation_prompt=True))
    own = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
    assert chat(server, messages=messages, chat_template=own)["usage"]["prompt_tokens"] == len(
        oracle_tokens(tiny_llama_dir, messages, own))


@pytest.mark.slow
def test_continue_final_message_goes_on_with_the_assistants_text(server, tiny_llama_dir):
    reply = chat(server, messages=STORY, add_generation_prompt=False, continue_final_message=True)
    expected = oracle_tokens(tiny_llama_dir, STORY, TEMPLATE, continue_final_message=True)
    assert reply["usage"]["prompt_tokens"] == len(expected), "the final message is left open, not closed"
    assert reply["usage"]["completion_tokens"] == 4 and reply["choices"][0]["message"]["content"]
    both = chat(server, messages=STORY, continue_final_message=True)
    assert both["error"]["param"] == "messages" and "add_generation_prompt" in both["error"]["message"]
    client = server.openai_client()
    with pytest.raises(openai.BadRequestError, match="assistant message"):
        client.chat.completions.create(model=server.get("/v1/models").json()["data"][0]["id"], messages=STORY[:1],
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})

