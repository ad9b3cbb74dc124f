"""Render a conversation with a Jinja chat template, as transformers'
`apply_chat_template(..., tokenize=False)` does, in a sandbox whose string
and list arithmetic is bounded.

Written here rather than called from transformers so that the process that
renders a request's template (frontend/sandbox.py) needs only jinja2, and so
that `*`, `+` and `**` are checked before they allocate: `{{ 'a' * 10**9 }}`
is refused, not computed. What the operators cannot see (a filter that pads,
`~` in a loop, a loop that never ends) the sandbox process bounds by its
memory limit and the API server by its time budget.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
"""Marks where the final message's text ends, so that the rest of the prompt can be cut (transformers' tag)."""
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""Names templates read a message's reasoning under; each gets a copy (as transformers does)."""
MAX_POWER_BITS = 4096
"""Largest integer `**` may make in a template, in bits."""


class TemplateTooLarge(ValueError):
    """A template's string, list or result grew past the limit."""


class GenerationBlocks(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the
    assistant's tokens with it (for training masks); a prompt is its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment whose `*`, `+` and `**` refuse
    results over `max_chars` items (characters of a string, items of a list)."""

    intercepted_binops = frozenset({"*", "+", "**"})

    def __init__(self, max_chars: int):
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlocks, jinja2.ext.loopcontrols])
        self.max_chars = max_chars
        self.filters["tojson"] = _tojson
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        self.globals["dict"] = lambda *args, **kwargs: dict(*args, **kwargs)

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            self._check_repeat(left, right)
            self._check_repeat(right, left)
        elif operator == "+" and _is_sized(left) and _is_sized(right):
            self._check_size(len(left) + len(right))
        elif operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0:
            if right * abs(left).bit_length() > MAX_POWER_BITS:
                raise TemplateTooLarge(f"{left} ** {right} is larger than the chat template may compute")
        return super().call_binop(context, operator, left, right)

    def _check_repeat(self, sequence: Any, times: Any) -> None:
        if _is_sized(sequence) and _is_int(times):
            self._check_size(len(sequence) * max(times, 0))

    def _check_size(self, size: int) -> None:
        if size > self.max_chars:
            raise TemplateTooLarge(f"the chat template made a string or list of {size} items, more than "
                                   f"the limit of {self.max_chars} (--max-prompt-chars)")


def _is_sized(value: Any) -> bool:
    return isinstance(value, (str, list, tuple))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' filter: Jinja's own escapes HTML characters, which no prompt wants.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def _compiled(template: str, max_chars: int) -> jinja2.Template:
    return BoundedEnvironment(max_chars).from_string(template)


def render_conversation(template: str, messages: list[dict], *, tools: list[dict] | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        variables: dict[str, Any] | None = None, max_chars: int) -> str:
    """The conversation as prompt text. `variables` are what else the
    template sees (the tokenizer's special tokens, chat_template_kwargs).
    ValueError (TemplateTooLarge for the size limit) when it cannot render."""
    messages = [_with_reasoning_aliases({k: v for k, v in m.items() if v is not None}) for m in messages]
    final_text = _tag_final_message(messages) if continue_final_message else None
    try:
        rendered = _compiled(template, max_chars).render(
            **(variables or {}), messages=messages, tools=tools, documents=None,
            add_generation_prompt=add_generation_prompt)
    except (TemplateTooLarge, MemoryError, RecursionError):
        raise  # the sandbox process says which limit
    except Exception as error:  # templates raise anything: jinja's errors, Python's from filters
        raise ValueError(f"the chat template failed: {type(error).__name__}: {error}") from None
    if len(rendered) > max_chars:
        raise TemplateTooLarge(f"the chat template rendered {len(rendered)} characters, more than the limit "
                               f"of {max_chars} (--max-prompt-chars)")
    if final_text is not None:
        rendered = _cut_after_final_message(rendered, final_text)
    return rendered


def _with_reasoning_aliases(message: dict) -> dict:
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(messages: list[dict]) -> str:
    """Append CONTINUE_TAG to the final message's text; return that text."""
    if not messages:
        raise ValueError("continue_final_message needs a message to continue")
    final = messages[-1]
    content = final.get("content")
    if isinstance(content, list):
        content = final["content"] = [dict(part) if isinstance(part, dict) else part for part in content]
        for part in reversed(content):
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                text = part["text"]
                part["text"] = text + CONTINUE_TAG
                return text
        raise ValueError("continue_final_message: the final message has no text to continue")
    if not isinstance(content, str):
        raise ValueError("continue_final_message: the final message has no content to continue")
    final["content"] = content + CONTINUE_TAG
    return content


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    if final_text.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message: the chat template dropped part of the final message")
    at = rendered.rindex(CONTINUE_TAG.strip())
    if rendered[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG:
        return rendered[:at]
    return rendered[:at].rstrip()  # the template trimmed the message's trailing space
