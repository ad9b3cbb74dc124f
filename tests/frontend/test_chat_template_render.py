"""fleet renders chat templates itself (frontend/chat_template.py: the
sandbox process needs only jinja2, and `*`/`+` are bounded). transformers'
apply_chat_template is the oracle: the same text for the templates models
ship (the default model's, a tool-calling one), continue_final_message,
reasoning fields and `{% generation %}`; and what the bound refuses."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from fleet.config.model import DEFAULT_MODEL
from fleet.config.model_files import locate_model
from fleet.frontend.chat_template import TemplateTooLarge, render_conversation
from fleet.frontend.tokenizer import render_chat
from fleet.workers.tokenizer import load_tokenizer

TOOL_TEMPLATE = (
    "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n{% endif %}"
    "{% for message in messages %}<|{{ message.role }}|>"
    "{% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}"
    "{% if message.content is string %}{{ message.content }}{% else %}"
    "{% for part in message.content %}{{ part.text }}{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<call>{{ call.function | tojson }}</call>"
    "{% endfor %}{% endif %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{{ bos_token }}{{ extra | default('') }}"
)
GENERATION_TEMPLATE = (
    "{% for message in messages %}{% if message.role == 'assistant' %}{% generation %}{{ message.content }}"
    "{% endgeneration %}{% else %}{{ message.content }}{% endif %}\n{% endfor %}"
)
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Today's weather, in °C",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CONVERSATIONS = [
    [{"role": "user", "content": "What is <b>2+2</b>?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello there "}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "text", "text": "part two"}]},
     {"role": "assistant", "content": None, "reasoning": "thinking it over",
      "tool_calls": [{"id": "1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]}],
]


@pytest.fixture(scope="module")
def default_tokenizer():
    from fleet.config.engine_args import EngineArgs

    return load_tokenizer(EngineArgs(model=locate_model(DEFAULT_MODEL, None), device="cpu").create_config().model)


@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["user", "system-assistant", "parts-tools-reasoning"])
@pytest.mark.parametrize("template", [None, TOOL_TEMPLATE, GENERATION_TEMPLATE], ids=["model", "tools", "generation"])
def test_renders_as_transformers_does(default_tokenizer, tiny_llama_dir, conversation, template):
    for tokenizer in (default_tokenizer, AutoTokenizer.from_pretrained(tiny_llama_dir)):
        for options in ({"add_generation_prompt": True}, {"add_generation_prompt": False},
                        {"tools": TOOLS, "add_generation_prompt": True, "extra": "kw"}):
            kwargs = {k: v for k, v in options.items() if k not in ("tools", "add_generation_prompt")}
            ours = lambda: render_chat(tokenizer, conversation, chat_template=template, tools=options.get("tools"),  # noqa: E731
                                       add_generation_prompt=options["add_generation_prompt"], template_kwargs=kwargs)
            try:
                expected = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                         tools=options.get("tools"),
                                                         add_generation_prompt=options["add_generation_prompt"],
                                                         **kwargs)
            except Exception as error:  # noqa: BLE001 - a template fails as it likes; ours must fail too
                with pytest.raises(ValueError, match=type(error).__name__):
                    ours()
                continue
            assert ours() == expected


PARTS = [{"role": "user", "content": "Say"}, {"role": "assistant", "content": [{"type": "text", "text": "Well, "}]}]


@pytest.mark.parametrize(("template", "conversation"), [(None, CONVERSATIONS[1]), (TOOL_TEMPLATE, CONVERSATIONS[1]),
                                                        (TOOL_TEMPLATE, PARTS)], ids=["model", "tools", "parts"])
def test_continues_the_final_message_as_transformers_does(default_tokenizer, template, conversation):
    given = repr(conversation)
    expected = default_tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                                     continue_final_message=True)
    assert render_chat(default_tokenizer, conversation, chat_template=template, add_generation_prompt=False,
                       continue_final_message=True) == expected
    assert repr(conversation) == given, "the caller's messages are left as given"


@pytest.mark.parametrize("template", [
    "{{ 'a' * 1001 }}", "{{ 1001 * 'a' }}", "{{ [0] * 2000 }}", "{{ 'a' * 600 + 'b' * 600 }}", "{{ 'x' * 2000 }}",
    "{{ 7 ** 99999 }}",
])
def test_arithmetic_past_the_limit_is_refused_before_it_allocates(template):
    with pytest.raises(TemplateTooLarge):
        render_conversation(template, [{"role": "user", "content": "hi"}], max_chars=1000)


def test_output_past_the_limit_is_refused_and_within_it_renders():
    messages = [{"role": "user", "content": "y" * 600}]
    with pytest.raises(TemplateTooLarge, match="rendered 1200 characters"):
        render_conversation("{{ messages[0].content }}{{ messages[0].content }}", messages, max_chars=1000)
    assert render_conversation("{{ 'ab' * 3 }}{{ 2 ** 10 }}{{ [1] + [2] }}", messages, max_chars=1000) == "ababab1024[1, 2]"


def test_the_sandbox_still_blocks_escapes():
    with pytest.raises(ValueError, match="the chat template failed"):
        render_conversation("{{ ''.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}],
                            max_chars=1000)
