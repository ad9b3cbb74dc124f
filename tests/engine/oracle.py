"""Transformers as the oracle: greedy continuations and log-softmax."""
from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.cache
def hf_model(path: str, gguf_file: str | None = None):
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


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
