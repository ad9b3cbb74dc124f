"""fleet.LLM: offline batched generation, with the engine core in its own process."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fleet.config.engine_args import EngineArgs
from fleet.config.model import DEFAULT_MODEL
from fleet.config.vllm_flags import check_vllm_keywords
from fleet.core.launch.memory import check_fits, node_memory
from fleet.core.messages import EngineCoreOutputs
from fleet.core.sampling_params import SamplingParams
from fleet.core.validation import RequestLimits, validate_request
from fleet.frontend.engine_client import EngineClient, EngineDeadError
from fleet.frontend.output_processor import (
    EMBEDDING_PARAMS,
    RequestOutput,
    RequestState,
    RequestTracker,
    child_requests,
)
from fleet.frontend.tokenizer import render_chat
from fleet.workers.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """LLM.embed's result, shaped as vLLM's: the vector is `.outputs.embedding`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True

    @classmethod
    def of(cls, output: RequestOutput) -> EmbeddingRequestOutput:
        return cls(output.request_id, output.prompt_token_ids, EmbeddingOutput(output.embedding or []), output.finished)


class LLM:
    """`LLM(model, **engine_args)`: any EngineArgs field as a keyword."""

    def __init__(self, model: str = DEFAULT_MODEL, **engine_args: Any):
        """vLLM's keywords that fleet has no field for are ignored with a log
        line, or refused, as the flags are (config/vllm_flags.py)."""
        fields = {field.name for field in dataclasses.fields(EngineArgs)}
        vllm_only = {name: value for name, value in engine_args.items() if name not in fields}
        for ignored in check_vllm_keywords(vllm_only):
            logger.warning("%s: ignored: %s", ignored.flag, ignored.reason)
        engine_args = {name: value for name, value in engine_args.items() if name in fields}
        self.config = EngineArgs(model=model, **engine_args).create_config()
        if self.config.parallel.data_parallel_size > 1:
            raise ValueError(
                "fleet.LLM runs one replica: serve --data-parallel-size > 1 with `fleet launch` "
                f"(got data_parallel_size={self.config.parallel.data_parallel_size})"
            )
        if self.config.device.device == "cpu":
            check_fits(node_memory(self.config))  # refuse now what the OOM killer would end later
        self.tokenizer = load_tokenizer(self.config.model)
        self.limits = RequestLimits.of(self.config)
        self._requests: RequestTracker[RequestState] = RequestTracker()
        self._ids = itertools.count()
        # The client's thread must not keep this object alive: it calls back
        # through a weak reference, so that `del llm` (or leaving its scope)
        # lets the finalizer stop the engine processes.
        me = weakref.ref(self)
        self.client = EngineClient(
            self.config,
            lambda outputs: (llm := me()) is not None and llm._on_outputs(outputs),
            lambda reason: (llm := me()) is not None and llm._on_death(reason),
        )
        self._stop_engines = weakref.finalize(self, self.client.shutdown, self.config.frontend.shutdown_timeout)
        self.client.start_engines()

    # ---- public API ------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) or _is_token_ids(prompts) else list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        states = [self._submit(prompt, params) for prompt, params in zip(prompt_list, params_list)]
        self._wait(states, use_tqdm)
        return [state.output for state in states]

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the chat template (`chat_template`,
        else --chat-template, else the tokenizer's), then generate. With
        `continue_final_message` (and add_generation_prompt=False) the model
        goes on with the final assistant message."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self._require_tokenizer()
        prompts = [
            render_chat(tokenizer, conversation, chat_template=chat_template or self.config.frontend.chat_template,
                        tools=tools, add_generation_prompt=add_generation_prompt,
                        continue_final_message=continue_final_message, template_kwargs=chat_template_kwargs)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order, as vLLM returns them
        (`.outputs.embedding`): the model's final hidden states pooled by
        --pooling-type (the last token's, or the mean), L2-normalised."""
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) or _is_token_ids(prompts) else list(prompts)
        pooling = self.config.model.pooling_type
        states = [self._submit(prompt, EMBEDDING_PARAMS, pooling) for prompt in prompt_list]
        self._wait(states, use_tqdm)
        return [EmbeddingRequestOutput.of(state.output) for state in states]

    def get_tokenizer(self):
        """The model's tokenizer (a transformers tokenizer), as vLLM's LLM.get_tokenizer."""
        return self._require_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What a request without SamplingParams gets: the model's generation
        config (--generation-config), else SamplingParams' own defaults."""
        return SamplingParams(**self.config.model.sampling_defaults)

    def abort(self, request_id: str) -> None:
        self.client.abort(self._requests.engine_ids(lambda state: state.output.request_id == request_id))

    def call_utility(self, method: str, *args: Any) -> Any:
        return self.client.call_utility(method, *args)

    def shutdown(self) -> None:
        """Stop the engine processes (also when this object is deleted or collected)."""
        self._stop_engines()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


    # ---- internals -------------------------------------------------------------------------

    def _submit(self, prompt: PromptType, params: SamplingParams, pooling: str | None = None) -> RequestState:
        """Raises InvalidParameter (a ValueError) as the API server answers 400."""
        text, token_ids = self._tokenize(prompt)
        validate_request(self.limits, token_ids, params)
        if params.structured_outputs is not None:
            params.structured_outputs.validate()  # here: offline, the grammar is the caller's own
        request_id = str(next(self._ids))
        state = RequestState(request_id, text, token_ids, params, self.tokenizer)
        children = child_requests(request_id, token_ids, params, time.time(), client_index=0, pooling=pooling)
        self._requests.add(children, state)
        for child in children:
            self.client.add_request(child)
        return state

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self._require_tokenizer().encode(prompt)
        return None, list(prompt)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise ValueError(f"model {self.config.model.model} has no tokenizer: pass prompts as token ids")
        return self.tokenizer

    def _on_outputs(self, outputs: EngineCoreOutputs) -> None:
        """On the engine client's output thread: outputs fold into their requests here."""
        to_abort = []
        for state, index, output in self._requests.route(outputs.outputs):
            if state.apply(index, output):
                to_abort.append(output.request_id)
            if state.output.outputs[index].finished:
                self._requests.remove([output.request_id])
                if state.output.finished:
                    state.done.set()
        self.client.abort(to_abort)

    def _on_death(self, reason: str) -> None:
        for state in self._requests.take_all():
            state.fail(reason)
            state.done.set()

    def _wait(self, states: list[RequestState], use_tqdm: bool) -> None:
        from tqdm import tqdm

        progress = tqdm(total=len(states), desc="generate", disable=not use_tqdm)
        try:
            for state in states:
                state.done.wait()
                progress.update(1)
        finally:
            progress.close()
        if self.client.dead_reason is not None:
            raise EngineDeadError(self.client.dead_reason)


def _is_token_ids(prompts: Any) -> bool:
    return isinstance(prompts, list) and bool(prompts) and isinstance(prompts[0], int)


def _broadcast_params(params: SamplingParams | Sequence[SamplingParams], count: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    if len(params) != count:
        raise ValueError(f"{len(params)} sampling params for {count} prompts")
    return list(params)
