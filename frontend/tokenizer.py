"""Render a chat for the model's tokenizer (workers/tokenizer.py loads it)."""
from __future__ import annotations

import logging

from fleet.frontend.chat_template import render_conversation
from fleet.frontend.sandbox import RenderChat

logger = logging.getLogger(__name__)


def chat_render_request(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                        tools: list[dict] | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, template_kwargs: dict | None = None) -> RenderChat:
    """What rendering the conversation needs, as transformers' apply_chat_template
    would render it: the template (`chat_template`, a template or the name of one
    of the tokenizer's, else the tokenizer's own) and the variables it sees (the
    tokenizer's special tokens, then `template_kwargs`). ValueError when it cannot render."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: "
                         "set add_generation_prompt to false to continue the final message")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the conversation to end with an assistant message")
    if not messages:
        raise ValueError("the conversation is empty: give at least one message")
    try:
        template = tokenizer.get_chat_template(chat_template, tools)
    except ValueError as error:
        raise ValueError(f"the chat template failed: {error}") from None
    return RenderChat(template, messages, tools, add_generation_prompt, continue_final_message,
                      {**tokenizer.special_tokens_map, **(template_kwargs or {})})


def render_chat(tokenizer, messages: list[dict], *, max_chars: int = 2**62, **options) -> str:
    """The conversation as prompt text, rendered here (offline use: the
    caller's own template); options as chat_render_request's."""
    request = chat_render_request(tokenizer, messages, **options)
    return render_conversation(request.template, request.messages, tools=request.tools,
                               add_generation_prompt=request.add_generation_prompt,
                               continue_final_message=request.continue_final_message,
                               variables=request.variables, max_chars=max_chars)
