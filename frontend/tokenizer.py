"""Load the tokenizer of a resolved model (HF directory or GGUF file)."""
from __future__ import annotations

import logging
import os
import shutil

from fleet.config.derived_cache import derived_path
from fleet.config.model import ModelConfig
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


def load_tokenizer(model: ModelConfig):
    """The HF tokenizer, or None when the model directory ships none (token-id prompts only)."""
    from transformers import AutoTokenizer

    path = model.tokenizer_path
    if path.endswith(".gguf"):
        return _tokenizer_from_gguf(path)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        logger.warning("no tokenizer at %s (%s): only token-id prompts work", path, error)
        return None


def _tokenizer_from_gguf(path: str):
    """Converting a GGUF vocabulary takes seconds: convert once, then load the
    saved HF tokenizer from fleet's cache."""
    from transformers import AutoTokenizer

    cached = derived_path(path, "gguf-tokenizer")
    if os.path.isfile(os.path.join(cached, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cached)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    staging = f"{cached}.{os.getpid()}.tmp"
    tokenizer.save_pretrained(staging)
    os.makedirs(os.path.dirname(cached), exist_ok=True)
    try:
        os.rename(staging, cached)  # atomic; another process may have won the race
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer
