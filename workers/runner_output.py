"""The last stage's side of a step: from the final hidden states to the
ModelRunnerOutput. Prompt logprobs, pooled embeddings, the rows whose logits
are sampled, and sampling with draft verification.

Every tensor rank of the last stage runs it: the LM head's logits are a
collective over the TP group. Only the driver (tensor rank 0) receives them
and returns an output."""
from __future__ import annotations

import logging

import torch

from fleet.config.fleet import FleetConfig
from fleet.core.messages import ModelRunnerOutput, TokenLogprobs
from fleet.workers.input_batch import CachedRequestState, StepBatch
from fleet.workers.sampler import SamplingRow, sample_isolating_failures, top_logprobs
from fleet.workers.spec_decode import verify_drafts
from fleet.workers.structured_output import Grammars

logger = logging.getLogger(__name__)


class RunnerOutputBuilder:
    def __init__(self, config: FleetConfig, model: torch.nn.Module, is_driver: bool):
        self.model = model
        self.is_driver = is_driver
        self.eos_token_ids = list(config.model.eos_token_ids)
        self.grammars = Grammars(config.model, config.model.hf_config.get("vocab_size") or 0)

    def build(self, step_id: int, batch: StepBatch, hidden: torch.Tensor) -> ModelRunnerOutput | None:
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        embeddings = self._pool(batch, hidden) if self.is_driver else {}
        sampling = _sampling_requests(batch)
        if not sampling:
            if not self.is_driver:
                return None
            return ModelRunnerOutput(step_id, [], [], None, prompt_logprobs, embeddings=embeddings)
        num_rows = [1 + len(batch.drafts[i]) for i in sampling]
        logits = self.model.compute_logits(hidden[_logit_rows(batch, sampling, num_rows)])  # collective over TP
        if not self.is_driver:  # only the driver (tensor rank 0) received the logits
            return None
        tokens, logprobs, errors = self._sample(batch, sampling, logits, num_rows)
        request_ids = [batch.requests[i].request_id for i in sampling]
        sampled_rows = [i for i in range(len(sampling)) if i not in errors]
        row_logprobs = [logprobs[i] for i in sampled_rows]
        return ModelRunnerOutput(
            step_id=step_id,
            request_ids=[request_ids[i] for i in sampled_rows],
            sampled_token_ids=[tokens[i] for i in sampled_rows],
            logprobs=row_logprobs if any(lp is not None for lp in row_logprobs) else None,
            prompt_logprobs=prompt_logprobs,
            failed={request_ids[i]: error for i, error in errors.items()},
            embeddings=embeddings,
        )

    def _sample(self, batch: StepBatch, sampling: list[int], logits: torch.Tensor, num_rows: list[int]
                ) -> tuple[list[list[int]], list[list[TokenLogprobs] | None], dict[int, str]]:
        """Per sampling request (index into `sampling`): its tokens, their logprobs, or why it failed.
        Requests without drafts are sampled as one batch; each with drafts verifies them alone."""
        rows = [self._sampling_row(batch.requests[i]) for i in sampling]
        plain = [j for j, i in enumerate(sampling) if not batch.drafts[i]]
        tokens: list[list[int]] = [[] for _ in sampling]
        logprobs: list[list[TokenLogprobs] | None] = [None for _ in sampling]
        errors: dict[int, str] = {}
        by_request = logits.split(num_rows)
        if plain:
            plain_logits = logits if len(plain) == len(sampling) else torch.cat([by_request[j] for j in plain])
            sampled, sampled_logprobs, plain_errors = sample_isolating_failures(plain_logits, [rows[j] for j in plain])
            for position, j in enumerate(plain):
                tokens[j] = [sampled[position]]
                logprobs[j] = None if sampled_logprobs[position] is None else [sampled_logprobs[position]]
            errors.update({plain[position]: error for position, error in plain_errors.items()})
        for j, i in enumerate(sampling):
            if batch.drafts[i]:
                try:
                    tokens[j], logprobs[j] = verify_drafts(by_request[j], rows[j], batch.drafts[i])
                except Exception as error:  # noqa: BLE001 - the request fails, the worker serves on
                    logger.exception("verifying the drafts of %s failed", batch.requests[i].request_id)
                    errors[j] = f"sampling failed: {type(error).__name__}: {error}"
        return tokens, logprobs, errors

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        params = state.params
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        if params.structured_outputs is not None and state.grammar is None:
            state.grammar = self.grammars.state(params.structured_outputs)
        return SamplingRow(params, state.prompt_token_ids, state.output_token_ids, state.generator, stop_ids,
                           state.grammar)

    def _pool(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, list[float]]:
        """Embedding requests: the pooled, L2-normalised final hidden state of
        each whose prompt is complete after this step. Mean pooling adds up
        each chunk's positions as the chunks come (a chunked prefill)."""
        pooling_rows = [index for index, state in enumerate(batch.requests) if state.pooling is not None]
        if not pooling_rows:
            return {}
        embeddings: dict[str, list[float]] = {}
        starts = batch.attention.query_start_loc.tolist()
        for index in pooling_rows:
            state = batch.requests[index]
            rows = hidden[starts[index] : starts[index + 1]].float()
            seq_len = batch.attention.seq_lens_list[index]
            if state.pooling == "mean":
                chunk_sum = rows.sum(dim=0)
                state.hidden_sum = chunk_sum if state.hidden_sum is None else state.hidden_sum + chunk_sum
            if seq_len < state.num_tokens:
                continue  # more of the prompt to come
            pooled = state.hidden_sum / seq_len if state.pooling == "mean" else rows[-1]
            embeddings[state.request_id] = torch.nn.functional.normalize(pooled, dim=0).tolist()
        return embeddings

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """For each request asking for them: logprobs of prompt tokens 1.. that
        this step's chunk predicts (hidden at position j predicts token j+1)."""
        result: dict[str, list[TokenLogprobs]] = {}
        offset = 0
        lengths = zip(batch.attention.query_lens, batch.attention.seq_lens_list, strict=True)
        for state, (n, seq_len) in zip(batch.requests, lengths, strict=True):
            start = seq_len - n
            last_predicting = min(seq_len, state.num_prompt_tokens - 1)
            if state.params.prompt_logprobs is not None and start < last_predicting:
                positions = slice(offset, offset + last_predicting - start)
                logits = self.model.compute_logits(hidden[positions])  # collective over the TP group
                if logits is not None:  # tensor rank 0 only
                    logprobs = torch.log_softmax(logits, dim=-1)
                    targets = state.prompt_token_ids[start + 1 : last_predicting + 1]
                    result[state.request_id] = [
                        top_logprobs(row, target, state.params.prompt_logprobs)
                        for row, target in zip(logprobs, targets, strict=True)
                    ]
            offset += n
        return result


def _sampling_requests(batch: StepBatch) -> list[int]:
    """Requests (indices into the batch) that sample a token: those whose
    known tokens are all computed after this step, embedding requests aside."""
    seq_lens = batch.attention.seq_lens_list
    return [i for i, state in enumerate(batch.requests) if seq_lens[i] >= state.num_tokens and state.pooling is None]


def _logit_rows(batch: StepBatch, sampling: list[int], num_rows: list[int]) -> list[int]:
    """Each sampling request's last position; with drafts, also the positions
    before it from its last token on."""
    ends = batch.attention.query_start_loc[1:].tolist()
    return [row for i, n in zip(sampling, num_rows, strict=True) for row in range(ends[i] - n, ends[i])]
