"""The OpenAI completions and chat completions endpoints: prompt in, response
(or server-sent event stream) out. Routes and errors live in api_server.py."""
from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec

from fleet.core.messages import KVTransferParams
from fleet.core.sampling_params import InvalidParameter, SamplingParams, StructuredOutputsParams
from fleet.core.validation import RequestLimits, validate_request
from fleet.frontend.async_engine import AsyncEngine
from fleet.frontend.output_processor import EMBEDDING_PARAMS, CompletionOutput, Logprob, RequestOutput, RequestState
from fleet.frontend.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest, now, random_id
from fleet.frontend.request_tokens import RequestTokens, fitting_max_tokens
from fleet.frontend.sandbox import Sandbox
from fleet.frontend.tokenizer import chat_render_request
from fleet.frontend.tool_calls import ToolCall, ToolChoice

COMPLETION_MAX_TOKENS = 16
"""max_tokens of a completion request that sets none."""
MAX_TEMPLATE_KWARGS_BYTES = 64 * 2**10
"""Largest chat_template_kwargs, as JSON: variables (enable_thinking), not documents."""


class RequestFailed(Exception):
    """The engine ended a request with an error (e.g. a worker died): HTTP 500."""


@dataclass
class Prepared:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer: KVTransferParams | None = None
    """Prefill/decode disaggregation: the request's kv_transfer_params."""


class Serving:
    """Requests validated and turned into engine work. What a request could
    make unbounded (its chat template, its grammar) runs in `sandbox`; every
    other cost is capped by a flag (config/frontend.py, README's limits)."""

    def __init__(self, engine: AsyncEngine, model_name: str, sandbox: Sandbox):
        self.engine = engine
        self.sandbox = sandbox
        self.tokenizer = engine.tokenizer
        self.model_name = model_name
        self.limits = engine.config.frontend
        self.request_limits = RequestLimits.of(engine.config)
        self.max_model_len = engine.config.model.max_model_len
        self.sampling_defaults = engine.config.model.sampling_defaults
        self.vocab_size = engine.config.model.hf_config.get("vocab_size")

    # ---- validation ---------------------------------------------------------------------

    def prepare(self, prompt: str | list[int], request, logprobs: int | None) -> Prepared:
        """One prompt tokenised with validated SamplingParams; raises InvalidParameter."""
        return self.prepare_prompts([prompt], request, logprobs)[0]

    def prepare_prompts(self, prompts: list[str | list[int]], request, logprobs: int | None) -> list[Prepared]:
        """Each prompt tokenised with validated SamplingParams, the request
        counted over all of them (frontend/request_tokens.py): past
        --max-request-tokens the rest is not tokenised, nor its grammar
        checked. Raises InvalidParameter."""
        prompt_param = "prompt" if isinstance(request, CompletionRequest) else "messages"
        counted = RequestTokens(self.limits.max_request_tokens, prompt_param)
        prepared = []
        for prompt in prompts:
            one = self._prepare_one(prompt, request, logprobs)
            counted.add(len(one.prompt_token_ids), one.params)
            prepared.append(one)
        constraint = prepared[0].params.structured_outputs  # the request's, the same for every prompt: checked once
        if constraint is not None:
            self.check_constraint(constraint, "structured_outputs")
        return prepared

    def _prepare_one(self, prompt: str | list[int], request, logprobs: int | None) -> Prepared:
        prompt, token_ids = self.tokenize_prompt(prompt)
        rest_of_context = self.max_model_len - len(token_ids)
        # Completions without max_tokens stop at 16 tokens (OpenAI and vLLM); chat at the end of the
        # context, or where the request's count reaches --max-request-tokens.
        if isinstance(request, CompletionRequest):
            default_max_tokens = min(COMPLETION_MAX_TOKENS, rest_of_context)
        else:
            default_max_tokens = min(rest_of_context, fitting_max_tokens(
                self.limits.max_request_tokens, len(token_ids), request.n, logprobs,
                request.prompt_logprobs_wanted(logprobs)))
        params = request.sampling_params(default_max_tokens, logprobs, self.sampling_defaults)
        validate_request(self.request_limits, token_ids, params)
        return Prepared(prompt, token_ids, params, self.kv_transfer(request.kv_transfer_params))

    def kv_transfer(self, body: dict | None) -> KVTransferParams | None:
        """A request's kv_transfer_params, if this instance's --kv-transfer-config role takes them."""
        if body is None:
            return None
        try:
            params = msgspec.convert(body, KVTransferParams)
        except msgspec.ValidationError as error:
            raise InvalidParameter("kv_transfer_params", str(error)) from None
        role = self.engine.config.kv_transfer
        if params.do_remote_decode and not (role and role.is_producer):
            raise InvalidParameter("kv_transfer_params", "do_remote_decode needs an instance started with "
                                                         "--kv-transfer-config kv_role kv_producer or kv_both")
        if params.do_remote_prefill and not (role and role.is_consumer):
            raise InvalidParameter("kv_transfer_params", "do_remote_prefill needs an instance started with "
                                                         "--kv-transfer-config kv_role kv_consumer or kv_both")
        return params if params.do_remote_decode or params.do_remote_prefill else None

    def check_constraint(self, constraint: StructuredOutputsParams, param: str) -> None:
        constraint.check_size(self.limits.max_structured_choices)
        self.sandbox.check_grammar(constraint, param)

    def tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt's text, or None for token ids; its token ids), not yet
        validated (validate_request); raises InvalidParameter."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameter("prompt", "this model has no tokenizer: send token ids")
            self.check_prompt_chars(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def embedding_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """tokenize_prompt, validated as an embedding request; raises InvalidParameter."""
        prompt, token_ids = self.tokenize_prompt(prompt)
        validate_request(self.request_limits, token_ids, EMBEDDING_PARAMS)
        return prompt, token_ids

    def check_prompt_chars(self, text: str, param: str) -> None:
        """Tokenising takes time in proportion to the text: a text that cannot
        fit the context is refused before it is tokenised."""
        if len(text) > self.limits.max_prompt_chars:
            raise InvalidParameter(param, f"the prompt has {len(text)} characters, more than the limit of "
                                          f"{self.limits.max_prompt_chars} (--max-prompt-chars)")

    def check_input_count(self, count: int, param: str) -> None:
        if count > self.limits.max_inputs_per_request:
            raise InvalidParameter(param, f"the request has {count} inputs, more than the limit of "
                                          f"{self.limits.max_inputs_per_request} (--max-inputs-per-request)")

    def prepare_chat(self, request: ChatCompletionRequest, logprobs: int | None) -> tuple[Prepared, ToolChoice]:
        """The chat prompt (tools shown to the model), its SamplingParams and
        how its reply is read; a forced tool choice constrains the output."""
        frontend = self.engine.config.frontend
        tools = ToolChoice(request.tool_dicts(), request.tool_choice_value(), frontend.tool_call_parser,
                           frontend.enable_auto_tool_choice, request.parallel_tool_calls)
        prepared = self.prepare(self.chat_prompt(request), request, logprobs)
        forced = tools.constraint()
        if forced is not None:
            if prepared.params.structured_outputs is not None:
                raise InvalidParameter("tool_choice", f"tool_choice {request.tool_choice_value()!r} constrains the "
                                                      "output already: drop response_format / structured_outputs")
            self.check_constraint(forced, "tool_choice")
            prepared.params = msgspec.structs.replace(prepared.params, structured_outputs=forced)
        return prepared, tools

    def chat_prompt(self, request: ChatCompletionRequest) -> str:
        """The rendered conversation, from the sandbox; raises InvalidParameter."""
        if self.tokenizer is None:
            raise InvalidParameter("messages", "this model has no tokenizer and no chat template")
        if request.chat_template is not None and not self.limits.trust_request_chat_template:
            raise InvalidParameter("chat_template", "this server does not run a request's own chat template: "
                                                    "start it with --trust-request-chat-template to allow them")
        tools = request.tool_dicts()
        if tools is not None and len(tools) > self.limits.max_tools:
            raise InvalidParameter("tools", f"the request lists {len(tools)} tools, more than the limit of "
                                            f"{self.limits.max_tools} (--max-tools)")
        kwargs = request.chat_template_kwargs
        if kwargs and len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise InvalidParameter("chat_template_kwargs", f"chat_template_kwargs is larger than "
                                                           f"{MAX_TEMPLATE_KWARGS_BYTES} bytes as JSON")
        try:
            render = chat_render_request(
                self.tokenizer,
                [m.for_template() for m in request.messages],
                chat_template=request.chat_template or self.limits.chat_template,
                tools=tools,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                template_kwargs=request.chat_template_kwargs,
            )
        except ValueError as error:
            raise InvalidParameter("messages", str(error)) from None
        return self.sandbox.render_chat(render)

    # ---- running -------------------------------------------------------------------------

    async def run_to_end(self, prepared: Prepared, priority: int = 0, pooling: str | None = None) -> RequestOutput:
        state = None
        params = prepared.params
        async for state in self.engine.generate(prepared.prompt, prepared.prompt_token_ids, params, priority, pooling,
                                                prepared.kv_transfer):
            pass
        assert state is not None
        _raise_if_failed(state.output)
        return state.output

    # ---- completions --------------------------------------------------------------------------

    async def completion(self, request: CompletionRequest, prepared: list[Prepared]) -> dict:
        outputs = await asyncio.gather(*(self.run_to_end(p, request.priority) for p in prepared))
        choices = []
        for prompt_index, output in enumerate(outputs):
            for sequence in output.outputs:
                text = self._prompt_text(output) + sequence.text if request.echo else sequence.text
                logprobs = None
                if request.logprobs is not None:
                    echoed = output if request.echo else None
                    logprobs = self._completion_logprobs(sequence, request.logprobs, echoed=echoed)
                choices.append(
                    {
                        "index": prompt_index * request.n + sequence.index,
                        "text": text,
                        "logprobs": logprobs,
                        "finish_reason": sequence.finish_reason,
                        "stop_reason": sequence.stop_reason,
                        "prompt_logprobs": _prompt_logprobs(output) if request.prompt_logprobs is not None else None,
                    }
                )
        return {
            "id": random_id("cmpl"),
            "object": "text_completion",
            "created": now(),
            "model": self.answered_name(request),
            "choices": choices,
            "usage": _usage(outputs),
            **_kv_transfer_params(outputs),
        }

    async def completion_stream(self, request: CompletionRequest, prepared: list[Prepared]) -> AsyncIterator[str]:
        base = {"id": random_id("cmpl"), "object": "text_completion", "created": now(),
                "model": self.answered_name(request)}
        outputs: list[RequestOutput] = []
        for prompt_index, p in enumerate(prepared):
            async for sequence, text, first, end, output in self.sequence_updates(p, request.priority, outputs):
                echo_now = request.echo and first == 0
                if echo_now:
                    text = self._prompt_text(output) + text
                logprobs = None
                if request.logprobs is not None:
                    echoed = output if echo_now else None
                    logprobs = self._completion_logprobs(sequence, request.logprobs, first, end, echoed=echoed)
                choice = {
                    "index": prompt_index * request.n + sequence.index,
                    "text": text,
                    "logprobs": logprobs,
                    "finish_reason": sequence.finish_reason,
                    "stop_reason": sequence.stop_reason,
                }
                if first == 0 and request.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(output)
                yield _event({**base, "choices": [choice], **self._running_usage(request, output, sequence)})
        if request.stream_options and request.stream_options.include_usage:
            yield _event({**base, "choices": [], "usage": _usage(outputs)})
        yield "data: [DONE]\n\n"

    # ---- embeddings ---------------------------------------------------------------------------

    async def embeddings(self, request: EmbeddingRequest, prompts: list[tuple[str | None, list[int]]]) -> dict:
        """One embedding per input, in order (the model's pooled final hidden states)."""
        pooling = self.engine.config.model.pooling_type
        outputs = await asyncio.gather(*(self.run_to_end(Prepared(prompt, token_ids, EMBEDDING_PARAMS), pooling=pooling)
                                         for prompt, token_ids in prompts))
        data = [{"object": "embedding", "index": index, "embedding": _encoded(output.embedding, request.encoding_format)}
                for index, output in enumerate(outputs)]
        prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
        return {"object": "list", "data": data, "model": self.answered_name(request),
                "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}

    # ---- chat -------------------------------------------------------------------------------

    async def chat(self, request: ChatCompletionRequest, prepared: Prepared, tools: ToolChoice) -> dict:
        output = await self.run_to_end(prepared, request.priority)
        choices = []
        for sequence in output.outputs:
            content, calls = tools.parse(sequence.text)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
            logprobs = None
            if request.logprobs:
                logprobs = {"content": self._chat_logprobs(sequence, request.top_logprobs or 0)}
            choices.append({
                "index": sequence.index,
                "message": message,
                "logprobs": logprobs,
                "finish_reason": _finish_reason(sequence, calls),
                "stop_reason": sequence.stop_reason,
            })
        return {
            "id": random_id("chatcmpl"),
            "object": "chat.completion",
            "created": now(),
            "model": self.answered_name(request),
            "choices": choices,
            "usage": _usage([output]),
            "prompt_logprobs": _prompt_logprobs(output) if request.prompt_logprobs is not None else None,
            **_kv_transfer_params([output]),
        }

    async def chat_stream(self, request: ChatCompletionRequest, prepared: Prepared,
                          tools: ToolChoice) -> AsyncIterator[str]:
        response_id, created = random_id("chatcmpl"), now()
        base = {"id": response_id, "object": "chat.completion.chunk", "created": created,
                "model": self.answered_name(request)}
        n = prepared.params.n
        for index in range(n):
            yield _event({**base, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]})
        outputs: list[RequestOutput] = []
        streams = [ToolCallStream(tools) for _ in range(n)]
        async for sequence, _text, first, end, output in self.sequence_updates(prepared, request.priority, outputs):
            logprobs = None
            if request.logprobs:
                logprobs = {"content": self._chat_logprobs(sequence, request.top_logprobs or 0, first, end)}
            deltas, calls = streams[sequence.index].advance(sequence)
            if not deltas and not (logprobs and logprobs["content"]):
                continue  # tokens held back (a call may be starting): nothing to send yet
            for position, delta in enumerate(deltas or [{}]):
                ends = sequence.finished and position == len(deltas) - 1
                choice = {
                    "index": sequence.index,
                    "delta": delta,
                    "logprobs": logprobs if position == 0 else None,
                    "finish_reason": _finish_reason(sequence, calls) if ends else None,
                }
                if ends:
                    choice["stop_reason"] = sequence.stop_reason
                yield _event({**base, "choices": [choice], **self._running_usage(request, output, sequence)})
        if request.stream_options and request.stream_options.include_usage:
            yield _event({**base, "choices": [], "usage": _usage(outputs)})
        yield "data: [DONE]\n\n"

    # ---- pieces -------------------------------------------------------------------------------

    async def sequence_updates(
        self, prepared: Prepared, priority: int, finished: list[RequestOutput]
    ) -> AsyncIterator[tuple[CompletionOutput, str, int, int, RequestOutput]]:
        """The streaming loop of every endpoint: (sequence, new text, first
        token, end token, the request's output) each time one of the
        request's sequences has something new to send. At the end the request's output is appended to
        `finished`, or its failure raised."""
        cursors = [StreamCursor() for _ in range(prepared.params.n)]
        state = None
        async for state in self.engine.generate(prepared.prompt, prepared.prompt_token_ids, prepared.params, priority,
                                                kv_transfer=prepared.kv_transfer):
            for sequence in state.output.outputs:
                step = cursors[sequence.index].advance(state, sequence)
                if step is not None:
                    yield (sequence, *step, state.output)
        assert state is not None
        _raise_if_failed(state.output)
        finished.append(state.output)

    def answered_name(self, request) -> str:
        """The model's name as the request gave it (any served name), else the first served name."""
        return request.model or self.model_name

    def _prompt_text(self, output: RequestOutput) -> str:
        """The prompt as text, for echo: a token-id prompt is decoded."""
        if output.prompt is not None or self.tokenizer is None:
            return output.prompt or ""
        return self.tokenizer.decode(output.prompt_token_ids)

    @staticmethod
    def _running_usage(request, output: RequestOutput, sequence: CompletionOutput) -> dict:
        """vLLM's stream_options.continuous_usage_stats: usage of the choice so far, in every chunk."""
        if not (request.stream_options and request.stream_options.continuous_usage_stats):
            return {}
        prompt, completion = len(output.prompt_token_ids), len(sequence.token_ids)
        return {"usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}

    def _token_text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id]) if self.tokenizer is not None else str(token_id)

    def _completion_logprobs(self, sequence: CompletionOutput, top_k: int, start: int = 0, stop: int | None = None,
                             echoed: RequestOutput | None = None) -> dict:
        """OpenAI's completion logprobs of tokens start..stop; with `echoed`,
        the prompt's tokens first (the first has no logprob: nothing predicts it)."""
        stop = len(sequence.token_ids) if stop is None else stop
        pairs = list(zip(sequence.token_ids[start:stop], (sequence.logprobs or [])[start:stop]))
        if echoed is not None:
            pairs = list(zip(echoed.prompt_token_ids, echoed.prompt_logprobs or [None])) + pairs
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        for token_id, entry in pairs:
            text = self._token_text(token_id, entry.get(token_id) if entry else None)
            tokens.append(text)
            token_logprobs.append(entry[token_id].logprob if entry else None)
            top.append({self._token_text(t, lp): lp.logprob for t, lp in _top(entry, token_id, top_k)}
                       if entry else None)
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    def _chat_logprobs(self, sequence: CompletionOutput, top_k: int, start: int = 0, stop: int | None = None) -> list[dict]:
        stop = len(sequence.token_ids) if stop is None else stop
        content = []
        for token_id, entry in zip(sequence.token_ids[start:stop], (sequence.logprobs or [])[start:stop]):
            text = self._token_text(token_id, entry.get(token_id))
            alternatives = _top(entry, token_id, top_k)
            content.append(
                {
                    "token": text,
                    "logprob": entry[token_id].logprob,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": self._token_text(t, lp), "logprob": lp.logprob, "bytes": list(self._token_text(t, lp).encode())}
                        for t, lp in alternatives
                    ],
                }
            )
        return content


@dataclass
class StreamCursor:
    """How much of one sequence a stream has sent."""

    text: int = 0
    """Characters of text sent."""
    tokens: int = 0
    """Tokens whose logprobs were sent."""
    done: bool = False
    """The final event (with the finish reason) was sent."""

    def advance(self, state: RequestState, sequence: CompletionOutput) -> tuple[str, int, int] | None:
        """The next event of the sequence: (new text, first token, end token),
        or None while there is nothing new to send."""
        if self.done:
            return None
        stable = state.detokenizers[sequence.index].stable_text_length(sequence.finished)
        text = sequence.text[self.text : stable]
        if not text and not sequence.finished:
            return None
        first, end = self.tokens, len(sequence.token_ids)
        self.text, self.tokens, self.done = max(self.text, stable), end, sequence.finished
        return text, first, end


class ToolCallStream:
    """One streamed choice of a chat with tools: its text goes out as content
    until a tool call may be starting; once the reply is complete, each call
    goes out as OpenAI streams one (a delta naming the function, then one with
    its arguments), before the final delta that carries the finish reason, so
    that the SDK's stream helpers see each call's arguments done. What the
    client pieces together is the non-streamed reply."""

    def __init__(self, tools: ToolChoice):
        self.tools = tools
        self.sent = 0
        """Characters of the text sent as content."""

    def advance(self, sequence: CompletionOutput) -> tuple[list[dict], list[ToolCall]]:
        """The deltas to send now (none while text is held back; once the
        sequence finished, at least one, the last ending the choice) and its calls."""
        text = sequence.text
        if not sequence.finished:
            safe = self.tools.content_prefix_length(text)
            content, self.sent = text[self.sent : max(safe, self.sent)], max(safe, self.sent)
            return ([{"content": content}] if content else []), []
        content, calls = self.tools.parse(text)
        sent, unsent = text[: self.sent], text[self.sent :]
        self.sent = len(text)
        if not calls:
            return [{"content": unsent} if unsent else {}], []
        deltas = []
        rest = (content or "")[len(sent.lstrip()) :]  # the reply's content is what was sent, then this
        if rest:
            deltas.append({"content": rest})
        for index, call in enumerate(calls):
            named = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
            deltas += [{"tool_calls": [named]}, {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}]
        return [*deltas, {}], calls


def _finish_reason(sequence: CompletionOutput, calls: list) -> str | None:
    """"tool_calls" when the model stopped after calling tools (not when max_tokens cut it)."""
    if calls and sequence.finish_reason == "stop":
        return "tool_calls"
    return sequence.finish_reason


def _raise_if_failed(output: RequestOutput) -> None:
    for sequence in output.outputs:
        if sequence.finish_reason == "error":
            raise RequestFailed(str(sequence.error))


def _encoded(embedding: list[float], encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: floats, or base64 of little-endian float32."""
    if encoding_format == "float":
        return embedding
    return base64.b64encode(struct.pack(f"<{len(embedding)}f", *embedding)).decode()


def _top(entry: dict[int, Logprob], token_id: int, top_k: int) -> list[tuple[int, Logprob]]:
    """The top_k alternatives, and the token taken whatever its rank."""
    return [(t, lp) for t, lp in entry.items() if lp.rank <= top_k or t == token_id]


def _prompt_logprobs(output: RequestOutput) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: logprob, rank, decoded_token}; None for the first."""
    if output.prompt_logprobs is None:
        return None
    return [
        None if entry is None else {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                                    for t, lp in entry.items()}
        for entry in output.prompt_logprobs
    ]


def _kv_transfer_params(outputs: list[RequestOutput]) -> dict:
    """A prefill instance's answer to do_remote_decode: where a decode instance takes the KV (vLLM's field)."""
    params = [output.kv_transfer_params for output in outputs if output.kv_transfer_params is not None]
    return {"kv_transfer_params": params[0]} if params else {}


def _usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(s.token_ids) for o in outputs for s in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
