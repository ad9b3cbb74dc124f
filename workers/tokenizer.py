"""Load the tokenizer of a resolved model (HF directory or GGUF file): the front
end tokenizes with it, a worker's grammars (structured outputs) mask by it."""
from __future__ import annotations

import logging
import os
import shutil

from fleet.config.derived_cache import derived_path
from fleet.config.model import ModelConfig

logger = logging.getLogger(__name__)


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
