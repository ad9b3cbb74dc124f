"""Turn the last hidden state's logits into the next token of each request.

Processing order follows vLLM: logit bias, min-tokens masking, penalties,
temperature, top-k / top-p / min-p, then sampling. Log-probabilities are of
the model's raw distribution (before any processing), as OpenAI reports them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fleet.core.messages import TokenLogprobs
from fleet.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class SamplingRow:
    """One request's row of the batch, as the sampler needs it."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None
    stop_ids_until_min_tokens: list[int]
    """Token ids (eos, stop ids) that must not be sampled before min_tokens outputs."""


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [num_rows, vocab] float32. Returns sampled ids and, per row, its logprobs (or None)."""
    raw_logprobs = _raw_logprobs_if_needed(logits, rows)
    logits = _process(logits, rows)
    sampled = _draw(logits, rows)
    logprobs = [
        None if raw_logprobs is None or row.params.logprobs is None else top_logprobs(raw_logprobs[i], sampled[i], row.params.logprobs)
        for i, row in enumerate(rows)
    ]
    return sampled, logprobs


def sample_isolating_failures(
    logits: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[int | None], list[TokenLogprobs | None], dict[int, str]]:
    """`sample`, but a row whose parameters make sampling raise fails alone:
    the batch is sampled again row by row, and each failing row's error comes
    back by index (its token is None) instead of ending the worker and, with
    it, every other request. The front ends validate parameters first; this
    is the guard behind them."""
    try:
        sampled, logprobs = sample(logits, rows)
        return list(sampled), logprobs, {}
    except Exception:  # noqa: BLE001 - which row failed, and why, is found below
        logger.exception("sampling a batch of %d rows failed; sampling each row alone", len(rows))
    tokens: list[int | None] = []
    logprobs: list[TokenLogprobs | None] = []
    errors: dict[int, str] = {}
    for index, row in enumerate(rows):
        try:
            (token,), (row_logprobs,) = sample(logits[index : index + 1], [row])
        except Exception as error:  # noqa: BLE001 - the request fails, the worker serves on
            token, row_logprobs, errors[index] = None, None, f"sampling failed: {type(error).__name__}: {error}"
        tokens.append(token)
        logprobs.append(row_logprobs)
    return tokens, logprobs, errors


def top_logprobs(logprobs: torch.Tensor, chosen: int, k: int) -> TokenLogprobs:
    """logprobs: [vocab]. The chosen token's logprob and rank, then the top k."""
    chosen_logprob = logprobs[chosen]
    rank = int((logprobs > chosen_logprob).sum()) + 1
    token_ids, values, ranks = [chosen], [float(chosen_logprob)], [rank]
    if k > 0:
        top = torch.topk(logprobs, k)
        token_ids += top.indices.tolist()
        values += top.values.tolist()
        ranks += list(range(1, k + 1))
    return TokenLogprobs(token_ids=token_ids, logprobs=values, ranks=ranks)


def _raw_logprobs_if_needed(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor | None:
    if all(row.params.logprobs is None for row in rows):
        return None
    return torch.log_softmax(logits, dim=-1)


def _process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    if any(row.params.logit_bias or _masks_stop_ids(row) or row.params.needs_penalties for row in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            _bias_mask_and_penalise(logits[i], row)
    if all(row.params.greedy for row in rows):
        return logits
    temperatures = torch.tensor([row.params.temperature if not row.params.greedy else 1.0 for row in rows], dtype=logits.dtype, device=logits.device)
    logits = logits / temperatures.unsqueeze(1)
    return _truncate(logits, rows)


def _masks_stop_ids(row: SamplingRow) -> bool:
    return bool(row.stop_ids_until_min_tokens) and len(row.output_token_ids) < row.params.min_tokens


def _bias_mask_and_penalise(row_logits: torch.Tensor, row: SamplingRow) -> None:
    """In place on one row: [vocab]."""
    params = row.params
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias.keys()), device=row_logits.device)
        row_logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=row_logits.dtype, device=row_logits.device)
    if _masks_stop_ids(row):
        row_logits[row.stop_ids_until_min_tokens] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long, device=row_logits.device)
        if seen.numel():
            values = row_logits[seen]
            row_logits[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.tensor(row.output_token_ids, device=row_logits.device).unique(return_counts=True)
        row_logits[ids] -= params.frequency_penalty * counts.to(row_logits.dtype) + params.presence_penalty


def _truncate(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """top-k, top-p and min-p, each only where some row asks for it."""
    top_ks = [row.params.top_k for row in rows]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[-1]
        k = torch.tensor([k if k > 0 else vocab for k in top_ks], device=logits.device).clamp(max=vocab)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_ps = [row.params.top_p for row in rows]
    if any(p < 1.0 for p in top_ps):
        p = torch.tensor(top_ps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= p  # keep the token that crosses p
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    min_ps = [row.params.min_p for row in rows]
    if any(p > 0.0 for p in min_ps):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _draw(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Greedy rows take the argmax; the others sample with the exponential
    trick (argmax of p / q, q ~ Exp(1)), each seeded row from its own
    generator so that its draw does not depend on the rest of the batch."""
    greedy = logits.argmax(dim=-1)
    if all(row.params.greedy for row in rows):
        return greedy.tolist()
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs)
    for i, row in enumerate(rows):
        if not row.params.greedy:
            noise[i].exponential_(generator=row.generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([row.params.greedy for row in rows], device=logits.device)
    return torch.where(is_greedy, greedy, sampled).tolist()
