"""OpenAI request and response bodies (pydantic), and their translation into
SamplingParams. Unknown request fields are accepted and logged."""
from __future__ import annotations

import json
import logging
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from fleet.core.sampling_params import INT64, InvalidParameter, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _warn_unknown_fields(self):
        if self.model_extra:
            logger.warning("ignoring unknown request fields: %s", sorted(self.model_extra))
        return self


LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""JSON's \\u escapes can spell half of a UTF-16 pair, which is no Unicode
character: no tokenizer, encoder or detokenizer can take such a string."""


class RequestBody(OpenAIBase):
    """A whole request body. Before any field is read, every string in it must
    be valid Unicode and every integer fit in 64 bits (what the wire and the
    tokenizer carry): anything else is a 400 naming where it was."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unencodable(cls, data: Any) -> Any:
        _check_encodable(data)
        return data


MAX_BODY_DEPTH = 100
"""Nesting of lists and objects a body may have: deeper ones are refused before
anything (pydantic, the JSON schema compiler, a template's tojson) recurses into them."""


def _check_encodable(body: Any) -> None:
    """Walks the body without recursion, so no nesting can exhaust the stack."""
    pending: list[tuple[Any, tuple[str | int, ...]]] = [(body, ())]
    while pending:
        value, path = pending.pop()
        if len(path) > MAX_BODY_DEPTH:
            field = str(path[0])
            raise InvalidParameter(field, f"{field} nests deeper than {MAX_BODY_DEPTH} levels of lists and objects")
        if isinstance(value, str):
            if LONE_SURROGATE.search(value):
                raise _lone_surrogate(path)
        elif isinstance(value, int) and not isinstance(value, bool):
            if value not in INT64:
                where = _where(path)
                raise InvalidParameter(where, f"{where} must be a 64-bit integer, got {value}")
        elif isinstance(value, dict):
            for key in value:  # before any item: an error names its path, which must be valid Unicode
                if LONE_SURROGATE.search(key):
                    raise _lone_surrogate(path)
            pending.extend((item, (*path, key)) for key, item in value.items())
        elif isinstance(value, list):
            pending.extend((item, (*path, index)) for index, item in enumerate(value))


def _where(path: tuple[str | int, ...]) -> str:
    return ".".join(str(part) for part in path) or "body"


def _lone_surrogate(path: tuple[str | int, ...]) -> InvalidParameter:
    where = _where(path)
    return InvalidParameter(where, f"{where} holds a lone UTF-16 surrogate, which is not valid Unicode")


class StreamOptions(OpenAIBase):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage of its choice so far."""


class JsonSchemaFormat(OpenAIBase):
    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIBase):
    """OpenAI's `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidParameter("response_format", 'response_format of type "json_schema" needs json_schema.schema')
        return StructuredOutputsParams(json=self.json_schema.schema_)


class StructuredOutputsRequest(OpenAIBase):
    """vLLM's `structured_outputs`: one of json, regex, choice, grammar, json_object."""

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.json_, regex=self.regex, choice=self.choice, grammar=self.grammar,
                                       json_object=self.json_object)


class SamplingFields(RequestBody):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    prompt_logprobs: int | None = None
    """vLLM's: log-probabilities of the prompt's tokens (and this many alternatives)."""
    kv_transfer_params: dict[str, Any] | None = None
    """vLLM's: prefill/decode disaggregation (core/kv_connector.py), between a proxy and instances with --kv-transfer-config."""
    # Structured outputs: OpenAI's field, vLLM's, and vLLM's older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def prompt_logprobs_wanted(self, logprobs: int | None) -> int | None:
        return self.prompt_logprobs

    def constraint(self) -> StructuredOutputsParams | None:
        """The one output constraint the request gives, however it spells it."""
        given = {}
        if self.response_format is not None and self.response_format.type != "text":
            given["response_format"] = self.response_format.constraint()
        if self.structured_outputs is not None:
            given["structured_outputs"] = self.structured_outputs.constraint()
        guided = StructuredOutputsParams(json=self.guided_json, regex=self.guided_regex, choice=self.guided_choice,
                                         grammar=self.guided_grammar)
        if guided != StructuredOutputsParams():
            given["guided_*"] = guided
        if len(given) > 1:
            raise InvalidParameter("structured_outputs", f"give one output constraint, got {', '.join(given)}")
        return next(iter(given.values()), None)

    def sampling_params(self, default_max_tokens: int, logprobs: int | None,
                        model_defaults: dict[str, Any] | None = None) -> SamplingParams:
        """`model_defaults` (--generation-config) fill the sampling fields this request left unset."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(_spells_token_id(key) for key in self.logit_bias or {}):
            raise InvalidParameter("logit_bias", "logit_bias keys must be token ids")
        logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        defaults = model_defaults or {}
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = min(default_max_tokens, defaults.get("max_tokens", default_max_tokens))

        def unless_set(name: str, builtin: Any) -> Any:
            value = getattr(self, name)
            if name in self.model_fields_set and value is not None:
                return value
            return defaults.get(name, builtin)

        return SamplingParams(
            n=self.n,
            temperature=unless_set("temperature", 1.0),
            top_p=unless_set("top_p", 1.0),
            top_k=unless_set("top_k", 0) or 0,
            min_p=unless_set("min_p", 0.0),
            seed=self.seed,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=unless_set("repetition_penalty", 1.0),
            logit_bias=logit_bias or None,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=self.prompt_logprobs_wanted(logprobs),
            structured_outputs=self.constraint(),
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _token_ids_are_integers(cls, data: Any) -> Any:
        _check_prompt_form(data, "prompt")
        return data

    def prompt_logprobs_wanted(self, logprobs: int | None) -> int | None:
        """echo with logprobs returns the prompt's logprobs too."""
        if self.echo and logprobs is not None:
            return max(logprobs, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    @model_validator(mode="after")
    def _no_best_of(self):
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameter("best_of", f"best_of other than n is not supported (best_of {self.best_of}, "
                                              f"n {self.n}): ask for n completions and choose among them")
        return self

    @model_validator(mode="after")
    def _no_suffix(self):
        if self.suffix:
            raise InvalidParameter("suffix", "suffix (insertion between a prompt and a suffix) is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: texts or token-id lists."""
        return texts_or_token_lists(self.prompt)


class ContentPart(OpenAIBase):
    """One part of a message's content: `{"type": "text", "text": ...}`, or
    another type (an image) that this server refuses."""

    type: str
    text: str = ""


class FunctionCall(OpenAIBase):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallMessage(OpenAIBase):
    """A call in an assistant message of the history."""

    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBase):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    """OpenAI's roles: a chat template given another may render it as it stands, or fail on it."""
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None
    """An assistant's calls (role "assistant")."""
    tool_call_id: str | None = None
    """The call a tool's result answers (role "tool")."""

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: arguments as objects, as Hugging Face's templates expect."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": call.id, "type": "function",
                 "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
                for call in self.tool_calls
            ]
        return message

    def text(self) -> str:
        """The message's text; a part of any other type (an image) is refused, not dropped."""
        if isinstance(self.content, list):
            kinds = {part.type for part in self.content} - {"text"}
            if kinds:
                raise InvalidParameter("messages", f"content parts of type {sorted(kinds)} are not "
                                                   "supported: this model takes text only")
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionDefinition(OpenAIBase):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(OpenAIBase):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(OpenAIBase):
    type: Literal["function"] = "function"
    function: dict[str, str]


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat template fields
    continue_final_message: bool = False
    """Leave the final (assistant) message open for the model to continue; needs add_generation_prompt false."""
    chat_template: str | None = None
    """A Jinja chat template for this request instead of the model's (or --chat-template)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template (e.g. enable_thinking)."""

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools else None

    def tool_choice_value(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice

    @model_validator(mode="after")
    def _completion_tokens_alias(self):
        """OpenAI's newer name wins when both are given, as in vLLM."""
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings request."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _no_dimensions(self):
        if self.dimensions is not None:
            raise InvalidParameter("dimensions", "dimensions (shortened embeddings) is not supported by this model")
        return self

    @model_validator(mode="before")
    @classmethod
    def _token_ids_are_integers(cls, data: Any) -> Any:
        _check_prompt_form(data, "input")
        return data

    def inputs(self) -> list[str | list[int]]:
        """The texts or token-id lists to embed."""
        return texts_or_token_lists(self.input)


class TokenizeRequest(RequestBody):
    """vLLM's /tokenize: a prompt, or messages rendered as a chat request with the same fields renders them."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request whose prompt these messages are."""
        fields = ("messages", "add_generation_prompt", "continue_final_message", "tools", "chat_template",
                  "chat_template_kwargs")
        return ChatCompletionRequest(**{field: getattr(self, field) for field in fields})


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[StrictInt]


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _is_token_id(value: Any) -> bool:
    """An integer, not a bool or a float: pydantic's lax mode would read true and 1.0 as the token id 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def _spells_token_id(key: str) -> bool:
    """A logit_bias key: ASCII digits, as OpenAI's clients write them (int() also takes "1_0", " 1" and "١")."""
    return key.isascii() and key.removeprefix("-").isdigit()


def _check_prompt_form(body: Any, field: str) -> None:
    """`field` of a raw body in one of OpenAI's prompt forms (see texts_or_token_lists), else a 400 naming it."""
    value = body.get(field) if isinstance(body, dict) else None
    if value is None or isinstance(value, str):
        return  # absent or text: pydantic's own checks
    if isinstance(value, list) and (all(isinstance(item, str) for item in value)
                                    or all(_is_token_id(item) for item in value)
                                    or all(isinstance(item, list) and all(map(_is_token_id, item)) for item in value)):
        return
    raise InvalidParameter(field, f"{field} must be a string, a list of strings, a list of token ids (integers: "
                                  "not booleans or floats) or a list of lists of token ids")


def texts_or_token_lists(value: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's prompt forms as a list: one text, texts, one token-id list, token-id lists."""
    if isinstance(value, str):
        return [value]
    if value and all(isinstance(x, int) for x in value):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


def _arguments(arguments: str | dict[str, Any]) -> Any:
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
