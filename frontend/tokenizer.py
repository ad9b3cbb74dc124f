"""Load the tokenizer of a resolved model (HF directory or GGUF file)."""
from __future__ import annotations

import logging
import os
import shutil

from fleet.config.derived_cache import derived_path
from fleet.config.model import ModelConfig

logger = logging.getLogger(__name__)


def render_chat(tokenizer, messages: list[dict], *, chat_template: str | None = None,
                tools: list[dict] | None = None, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
    """The conversation as prompt text, by `chat_template` or else the
    tokenizer's own. `continue_final_message` leaves the last (assistant)
    message open for the model to go on with. ValueError when it cannot render."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be true: "
                         "set add_generation_prompt to false to continue the final message")
    if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
        raise ValueError("continue_final_message needs the conversation to end with an assistant message")
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )
    except Exception as error:  # templates raise anything from jinja
        raise ValueError(f"the chat template failed: {error}") from None


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
