"""Turn the last hidden state's logits into the next token of each request.

Processing order follows vLLM: logit bias, min-tokens masking, penalties,
the grammar's mask (structured outputs), temperature, top-k / top-p / min-p,
then sampling. Log-probabilities are of
the model's raw distribution (before any processing), as OpenAI reports them.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from fleet.core.messages import TokenLogprobs
from fleet.core.sampling_params import SamplingParams
from fleet.workers.structured_output import GrammarState, allowed_tokens

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
    grammar: GrammarState | None = None
    """The tokens a constrained request may take next (structured outputs)."""


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [num_rows, vocab] float32. Returns sampled ids and, per row, its logprobs (or None)."""
    raw_logprobs = _raw_logprobs_if_needed(logits, rows)
    logits = process(logits, rows)
    sampled = draw(logits, rows)
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


def process(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Each row's logits as its parameters shape them (bias, masks, penalties, grammar, temperature, truncation)."""
    constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
    if constrained or any(row.params.logit_bias or _masks_stop_ids(row) or row.params.needs_penalties for row in rows):
        logits = logits.clone()
        for i, row in enumerate(rows):
            _bias_mask_and_penalise(logits[i], row)
    if constrained:  # all constrained rows' masks at once: one unpack, one fill
        allowed = allowed_tokens([(rows[i].grammar, rows[i].output_token_ids) for i in constrained],
                                 logits.shape[-1], logits.device)
        index = torch.tensor(constrained, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
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


TOP_P_CANDIDATES = 1024
"""Tokens top-p first looks among (a partial sort); rows whose top 1024 hold
less than p of the probability fall back to sorting the whole vocabulary."""


def _truncate(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """top-k, top-p and min-p, each only where some row asks for it. No full
    sort of the vocabulary unless a row's top-p set is very wide: sorting
    [32, 49152] costs 70 ms on a 2-core CPU, a top-1024 3 ms."""
    vocab = logits.shape[-1]
    top_ks = [row.params.top_k if 0 < row.params.top_k < vocab else vocab for row in rows]
    top_ps = [row.params.top_p for row in rows]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _top_k_top_p(logits, top_ks, top_ps)
    min_ps = [row.params.min_p for row in rows]
    if any(p > 0.0 for p in min_ps):
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_ps, dtype=logits.dtype, device=logits.device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float], sort_all: bool = False) -> torch.Tensor:
    """Keep, per row, its top k tokens, then the fewest of them whose
    probability (among those k) reaches p: the token that crosses p stays,
    and so do ties with the last token kept. top_ks use the vocabulary size
    for "no top-k". Only the largest logits are sorted, unless a row's set
    may reach beyond them: those rows are done again over the whole vocabulary."""
    vocab = logits.shape[-1]
    device = logits.device
    wants_p = any(p < 1.0 for p in top_ps)
    limited = [k for k in top_ks if k < vocab]
    width = vocab if sort_all else min(vocab, max(limited + ([TOP_P_CANDIDATES] if wants_p else [])))
    # [rows, width], descending (a full sort is faster than topk of everything)
    values = logits.sort(dim=-1, descending=True).values if width == vocab else logits.topk(width, dim=-1).values
    k = torch.tensor(top_ks, device=device)
    p = torch.tensor(top_ps, dtype=torch.float64, device=device)
    values = values.masked_fill(torch.arange(width, device=device) >= k.unsqueeze(1), float("-inf"))
    beyond = torch.zeros_like(p, dtype=torch.bool)
    if wants_p:
        # Normalised over all the tokens top-k keeps: the whole row, or the top k seen here.
        normaliser = torch.where(k >= vocab, logits.double().logsumexp(dim=-1), values.double().logsumexp(dim=-1))
        probs = (values.double() - normaliser.unsqueeze(1)).exp()
        cumulative = probs.cumsum(dim=-1)
        values = values.masked_fill(cumulative - probs >= p.unsqueeze(1), float("-inf"))
        beyond = (p < 1.0) & (k > width) & ((k < vocab) | (cumulative[:, -1] < p))
    threshold = values.masked_fill(values == float("-inf"), float("inf")).min(dim=-1).values
    threshold = threshold.masked_fill((k >= vocab) & (p >= 1.0), float("-inf"))  # rows that keep everything
    kept = logits.masked_fill(logits < threshold.unsqueeze(1), float("-inf"))
    rows = beyond.nonzero().flatten().tolist()
    if rows:
        kept[rows] = _top_k_top_p(logits[rows], [top_ks[i] for i in rows], [top_ps[i] for i in rows], True)
    return kept


def draw(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """Greedy rows take the argmax; the others invert their cumulative
    distribution at one uniform draw each, a seeded row's from its own
    generator so that its draw does not depend on the rest of the batch.
    (One number per row: an exponential or Gumbel draw per vocabulary entry
    costs 40 ms for 32 rows of 49 152 on a 2-core CPU.)"""
    is_greedy = [row.params.greedy for row in rows]
    if all(is_greedy):
        return logits.argmax(dim=-1).tolist()
    # float32 sums are off by about 1e-5 of the total over 49 152 tokens: a
    # bias far below what sampling can show, for half the memory traffic.
    cdf = logits.softmax(dim=-1).cumsum(dim=-1)
    uniform = torch.rand(len(rows), 1, device=logits.device)
    for i, row in enumerate(rows):
        if row.generator is not None and not row.params.greedy:
            uniform[i] = torch.rand(1, device=logits.device, generator=row.generator)
    # The first token whose cumulative probability exceeds the draw; a token
    # of probability 0 has an empty interval and is never chosen.
    sampled = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1).clamp(max=logits.shape[-1] - 1)
    if not any(is_greedy):
        return sampled.tolist()
    greedy = logits.argmax(dim=-1)
    is_greedy = torch.tensor(is_greedy, device=logits.device)
    return torch.where(is_greedy, greedy, sampled).tolist()
