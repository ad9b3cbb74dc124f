"""Speculative decoding on the worker: keep the draft tokens the model agrees with.

A request with drafts d_0 .. d_{k-1} computed its last token and the k drafts in
one forward, so the step has k + 1 rows of logits: row i is the distribution of
the token after d_{i-1}. Row i is shaped by the request's parameters as if
d_0 .. d_{i-1} were already output (penalties, min_tokens), then:
  - greedy: d_i is kept while it is row i's argmax; the first argmax that differs
    (or row k's, when all are kept) is the step's own token. Output is the same
    tokens as without drafts.
  - sampled (speculative sampling with a draft that is certain, q = 1 at d_i):
    d_i is kept with probability p_i(d_i); once one is rejected, the token is drawn
    from p_i without d_i (the residual max(p - q, 0), normalised); when all are kept,
    from row k. Each output token has exactly the distribution sampling it alone has.
"""
from __future__ import annotations

import dataclasses

import torch

from fleet.core.messages import TokenLogprobs
from fleet.workers.sampler import SamplingRow, draw, process, top_logprobs


def verify_drafts(
    logits: torch.Tensor, row: SamplingRow, drafts: list[int]
) -> tuple[list[int], list[TokenLogprobs] | None]:
    """logits: [len(drafts) + 1, vocab] float32. Returns the kept drafts and the token after them,
    and their logprobs (of the raw distribution, as sampling reports them) if the request wants them."""
    k = len(drafts)
    rows = [dataclasses.replace(row, output_token_ids=row.output_token_ids + drafts[:i]) for i in range(k + 1)]
    shaped = process(logits, rows)
    if row.params.greedy:
        best = shaped.argmax(dim=-1).tolist()
        num_kept = 0
        while num_kept < k and best[num_kept] == drafts[num_kept]:
            num_kept += 1
        tokens = drafts[:num_kept] + [best[num_kept]]
    else:
        tokens = _speculative_sample(shaped, rows, drafts)
    if row.params.logprobs is None:
        return tokens, None
    raw = torch.log_softmax(logits[: len(tokens)], dim=-1)
    return tokens, [top_logprobs(raw[i], token, row.params.logprobs) for i, token in enumerate(tokens)]


def _speculative_sample(shaped: torch.Tensor, rows: list[SamplingRow], drafts: list[int]) -> list[int]:
    probs = shaped.softmax(dim=-1)
    generator = rows[0].generator
    for i, draft in enumerate(drafts):
        if torch.rand(1, device=shaped.device, generator=generator).item() < probs[i, draft].item():
            continue
        residual = shaped[i].clone()
        residual[draft] = float("-inf")
        if torch.isfinite(residual).any():  # (else p(draft) = 1 up to rounding: it stays)
            return drafts[:i] + draw(residual.unsqueeze(0), [rows[i]])
    return drafts + draw(shaped[-1:], [rows[-1]])
