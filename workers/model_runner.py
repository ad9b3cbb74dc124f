"""One step on one worker: SchedulerOutput -> batch tensors -> forward -> sample."""
from __future__ import annotations

import logging
import math
import mmap

import torch

from fleet.config.fleet import FleetConfig
from fleet.core.kv_blocks import kv_bytes_per_block
from fleet.core.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from fleet.parallel.comm import get_pp_group
from fleet.workers.compiled_decode import CompiledDecode
from fleet.workers.input_batch import CachedRequests, CachedRequestState, StepBatch
from fleet.workers.kv_transfer import WorkerKVTransfer
from fleet.workers.sampler import SamplingRow, sample_isolating_failures, top_logprobs
from fleet.workers.spec_decode import verify_drafts
from fleet.workers.structured_output import Grammars

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: FleetConfig, model: torch.nn.Module, device: torch.device, is_driver: bool = True):
        self.config = config
        self.is_driver = is_driver
        self.stage = get_pp_group()
        # Replicas in lock-step run a forward every step, with no tokens if need
        # be, so that the expert-parallel collectives of the others complete.
        self.forward_every_step = config.parallel.replicas_step_together
        self.model = model
        self.device = device
        self.dtype = TORCH_DTYPES[config.model.dtype]
        self.block_size = config.cache.block_size
        self.states = CachedRequests(device, self.block_size)
        self.kv_caches: list[torch.Tensor] = []
        self.eos_token_ids = list(config.model.eos_token_ids)
        self.grammars = Grammars(config.model, config.model.hf_config.get("vocab_size") or 0)
        self.compiled = CompiledDecode(config, model, device) if config.compilation.mode == "torch_compile" else None
        self.kv_transfer: WorkerKVTransfer | None = None
        """Prefill/decode disaggregation (set by the worker when --kv-transfer-config is given)."""

    # ---- KV cache -------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.block_size, self.model.num_kv_heads, self.model.head_dim,
                                  self.model.num_layers, self.dtype.itemsize)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.model.num_kv_heads, self.model.head_dim)
        allocate = _zeros_committed_on_use if self.device.type == "cpu" else torch.zeros
        self.kv_caches = [allocate(shape, dtype=self.dtype, device=self.device) for _ in range(self.model.num_layers)]
        if self.compiled is not None:
            with torch.inference_mode():  # as execute runs: the graphs guard on it
                self.compiled.warm_up(self.kv_caches, self.dtype)

    # ---- one step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Every worker runs it (collectives need all of them);
        only the driver (tensor rank 0 of the last stage) returns an output."""
        self.states.apply(scheduler_output)
        loads_done, load_failed = [], {}
        if self.kv_transfer is not None:
            loads_done, load_failed = self.kv_transfer.step(scheduler_output, self.kv_caches)
        output = self._execute(scheduler_output)
        if output is not None:
            output.kv_loads_done, output.kv_load_failed = loads_done, load_failed
        return output

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        step_id = scheduler_output.step_id
        if not scheduler_output.num_scheduled_tokens and not self.forward_every_step:
            return ModelRunnerOutput(step_id=step_id, request_ids=[], sampled_token_ids=[]) if self.is_driver else None
        batch = self.states.build_batch(scheduler_output)
        intermediate = None
        if not self.stage.is_first:
            shape = (2, len(batch.input_ids), self.model.spec.hidden_size)  # hidden and residual
            intermediate = self.stage.recv_prev(shape, self.dtype, self.device)
        forward = self.model
        if self.compiled is not None and self.compiled.applies(batch.attention):
            forward = self.compiled
        hidden = forward(batch.input_ids, batch.positions, self.kv_caches, batch.attention, intermediate)
        if not self.stage.is_last:
            self.stage.send_next(hidden)
            return None
        prompt_logprobs = self._prompt_logprobs(batch, hidden)
        embeddings = self._pool(batch, hidden) if self.is_driver else {}
        complete = [i for i, state in enumerate(batch.requests) if batch.attention.seq_lens_list[i] >= state.num_tokens]
        sampling = [i for i in complete if batch.requests[i].pooling is None]
        if not sampling:
            if not self.is_driver:
                return None
            return ModelRunnerOutput(step_id, [], [], None, prompt_logprobs, embeddings=embeddings)
        # Each request's last position; with drafts, also the positions before it from its last token on.
        ends = batch.attention.query_start_loc[1:].tolist()
        num_rows = [1 + len(batch.drafts[i]) for i in sampling]
        logit_rows = [row for i, n in zip(sampling, num_rows) for row in range(ends[i] - n, ends[i])]
        logits = self.model.compute_logits(hidden[logit_rows])  # collective over the TP group
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

    def _sampling_row(self, state: CachedRequestState) -> SamplingRow:
        params = state.params
        stop_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else self.eos_token_ids)
        if params.structured_outputs is not None and state.grammar is None:
            state.grammar = self.grammars.state(params.structured_outputs)
        return SamplingRow(params, state.prompt_token_ids, state.output_token_ids, state.generator, stop_ids,
                           state.grammar)

    def _prompt_logprobs(self, batch: StepBatch, hidden: torch.Tensor) -> dict[str, list[TokenLogprobs]]:
        """For each request asking for them: logprobs of prompt tokens 1.. that
        this step's chunk predicts (hidden at position j predicts token j+1)."""
        result: dict[str, list[TokenLogprobs]] = {}
        offset = 0
        for state, n, seq_len in zip(batch.requests, batch.attention.query_lens, batch.attention.seq_lens_list):
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


def _zeros_committed_on_use(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros in an anonymous mapping: the kernel hands out zero pages as they
    are first written, so the KV cache holds RAM for the blocks used, not for
    its whole budget (torch.zeros would write every page at start-up). The
    mapping is still reserved memory to Linux (Committed_AS), which the
    memory plan of a later launch counts as used."""
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


