"""Load the tokenizer of a resolved model (HF directory or GGUF file)."""
from __future__ import annotations

import logging
import os

from fleet.config.model import ModelConfig

logger = logging.getLogger(__name__)


def load_tokenizer(model: ModelConfig):
    """The HF tokenizer, or None when the model directory ships none (token-id prompts only)."""
    from transformers import AutoTokenizer

    path = model.tokenizer_path
    if path.endswith(".gguf"):
        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as error:
        logger.warning("no tokenizer at %s (%s): only token-id prompts work", path, error)
        return None
