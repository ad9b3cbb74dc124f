"""Transformers as the oracle: greedy continuations and log-softmax."""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile

import safetensors.torch
import torch
import transformers
from transformers import AutoModelForCausalLM

ORACLE_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "fleet", "test-oracles")
"""transformers' float32 copies of GGUF files the tests compare against."""


@functools.cache
def hf_model(path: str, gguf_file: str | None = None):
    if gguf_file:
        path = _converted_by_transformers(os.path.join(path, gguf_file))
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _converted_by_transformers(gguf_path: str) -> str:
    """transformers' own float32 model of a GGUF, saved once in a cache folder:
    loading a GGUF takes transformers ~20 s (most of it reading the file's
    metadata in Python), every pytest process and CPU class again; its saved
    copy loads in about a second. Keyed by the file and transformers' version."""
    stat = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{stat.st_size}:{stat.st_mtime_ns}:{transformers.__version__}"
    folder = os.path.join(ORACLE_CACHE, hashlib.sha256(key.encode()).hexdigest()[:24])
    if not os.path.isdir(folder):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32)
        os.makedirs(ORACLE_CACHE, exist_ok=True)
        partial = tempfile.mkdtemp(dir=ORACLE_CACHE)
        # save_pretrained refuses a model read from GGUF: its float32 weights and config as any checkpoint's
        model.config.__dict__.pop("quantization_config", None)
        model.config.save_pretrained(partial)
        safetensors.torch.save_model(model, os.path.join(partial, "model.safetensors"))
        try:
            os.rename(partial, folder)  # whole or absent, even with two pytest processes at once
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)  # the other one was first
    return folder


@torch.inference_mode()
def greedy(model, prompt_token_ids: list[int], max_new_tokens: int, repetition_penalty: float = 1.0) -> list[int]:
    """Exactly max_new_tokens greedy tokens; eos is masked until then, so compare
    with fleet's `min_tokens=max_tokens` (not ignore_eos, which lets eos be sampled)."""
    input_ids = torch.tensor([prompt_token_ids])
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        repetition_penalty=repetition_penalty,
        pad_token_id=0,
    )
    return out[0, len(prompt_token_ids) :].tolist()


@torch.inference_mode()
def log_softmax(model, token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: log-probabilities of the next token at each position."""
    logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)
