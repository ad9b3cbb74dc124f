"""OpenAI's Responses request body, and its translation into the chat
completion request that the engine already serves: input items become chat
messages, function tools chat tools, `text.format` a response_format."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from fleet.core.sampling_params import InvalidParameter
from fleet.frontend.protocol import ChatCompletionRequest, OpenAIBase, RequestBody

BUILT_IN_TOOLS = ("web_search", "web_search_preview", "file_search", "code_interpreter", "computer_use_preview",
                  "computer", "image_generation", "mcp", "local_shell", "shell", "apply_patch", "custom")
"""Tool types OpenAI runs on its side: this server runs none of them."""
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
"""OpenAI's limits on `metadata`."""


class TextFormat(OpenAIBase):
    """`text.format`: plain text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIBase):
    format: TextFormat = TextFormat()


class ResponsesRequest(RequestBody):
    """POST /v1/responses."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # vLLM's extras, as on the chat endpoint
    top_k: int | None = None
    seed: int | None = None
    priority: int = 0

    @model_validator(mode="after")
    def _check(self):
        if self.background and not self.store:
            raise InvalidParameter("background", "background responses need store: true (they are fetched by id)")
        if self.background and self.stream:
            raise InvalidParameter("background", "background responses are not streamed here: "
                                                 "poll GET /v1/responses/{id} instead")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise InvalidParameter("max_output_tokens", "max_output_tokens must be at least 1")
        _check_metadata(self.metadata)
        return self

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The function tools, as chat completions spell them."""
        if not self.tools:
            return None
        tools = []
        for index, tool in enumerate(self.tools):
            kind = tool.get("type")
            where = f"tools[{index}]"
            if kind in BUILT_IN_TOOLS:
                raise InvalidParameter(where, f"{where}: built-in tool type {kind!r} is not supported by this "
                                              "server: give tools of type \"function\"")
            if kind != "function":
                raise InvalidParameter(where, f"{where}: unknown tool type {kind!r}: give tools of type \"function\"")
            if not isinstance(tool.get("name"), str) or not tool["name"]:
                raise InvalidParameter(where, f"{where}: a function tool needs a name")
            function = {"name": tool["name"], "description": tool.get("description"),
                        "parameters": tool.get("parameters")}
            tools.append({"type": "function", "function": {k: v for k, v in function.items() if v is not None}})
        return tools

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto", "required"):
            return choice
        if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        kind = choice.get("type") if isinstance(choice, dict) else choice
        raise InvalidParameter("tool_choice", f"tool_choice {kind!r} is not supported: give \"none\", \"auto\", "
                                              "\"required\" or {\"type\": \"function\", \"name\": ...}")

    def response_format(self) -> dict[str, Any] | None:
        form = (self.text or TextConfig()).format
        if form.type == "text":
            return None
        if form.type == "json_object":
            return {"type": "json_object"}
        if form.schema_ is None:
            raise InvalidParameter("text.format", 'text.format of type "json_schema" needs a schema')
        return {"type": "json_schema", "json_schema": {"name": form.name or "response", "schema": form.schema_,
                                                        "strict": form.strict}}

    def input_items(self) -> list[dict[str, Any]]:
        """The input as items (a string is one user message)."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return self.input

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request: instructions as the system message,
        then `history` (a previous response's conversation), then the input."""
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + history
        messages += items_to_messages(self.input_items())
        fields: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "tools": self.chat_tools(), "tool_choice": self.chat_tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls, "response_format": self.response_format(),
            "user": self.user, "top_k": self.top_k, "seed": self.seed, "priority": self.priority,
        }
        for name in ("temperature", "top_p"):  # unset stays unset: --generation-config's defaults apply
            if name in self.model_fields_set:
                fields[name] = getattr(self, name)
        return ChatCompletionRequest(**{k: v for k, v in fields.items() if v is not None})


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a message item is a message
    (developer becomes system), function calls join the assistant message
    before them, a function call's output is a tool message."""
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise InvalidParameter(where, f"{where} must be an object (an input item)")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            call = {"id": _text_field(item, "call_id", where), "type": "function",
                    "function": {"name": _text_field(item, "name", where),
                                 "arguments": _text_field(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _parts_text(output, where + ".output")
            if not isinstance(output, str):
                raise InvalidParameter(where, f"{where}.output must be a string")
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", where), "content": output})
        elif kind == "reasoning":
            continue  # this server's models write no separate reasoning items; one fed back carries nothing to show
        else:
            raise InvalidParameter(where, f"{where}: input items of type {kind!r} are not supported: give "
                                          "\"message\", \"function_call\" or \"function_call_output\" items")
    return messages


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise InvalidParameter(where, f"{where}.role must be user, assistant, system or developer, got {role!r}")
    content = item.get("content")
    if isinstance(content, list):
        content = _parts_text(content, where + ".content")
    if not isinstance(content, str):
        raise InvalidParameter(where, f"{where}.content must be a string or a list of text parts")
    return {"role": "system" if role == "developer" else role, "content": content}


def _parts_text(parts: list[Any], where: str) -> str:
    texts = []
    for index, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise InvalidParameter(where, f"{where}[{index}]: content parts of type {kind!r} are not supported: "
                                          "this model takes text (input_text) only")
        texts.append(part["text"])
    return "".join(texts)


def _text_field(item: dict[str, Any], name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise InvalidParameter(where, f"{where}.{name} must be a string")
    return value


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise InvalidParameter("metadata", f"metadata has {len(metadata)} pairs, more than {MAX_METADATA_PAIRS}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
            raise InvalidParameter("metadata", f"metadata keys are at most {MAX_METADATA_KEY} characters and values "
                                               f"at most {MAX_METADATA_VALUE}")
