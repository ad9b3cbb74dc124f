"""Tool calling for chat completions, as vLLM does it.

- tool_choice "required" or a named function: the output is constrained
  (structured outputs) to a JSON list of calls, or to the function's
  arguments, so it always parses into calls.
- tool_choice "auto" (--enable-auto-tool-choice): the model writes calls in
  its text, in the format of --tool-call-parser, and the parser reads them out.
- tool_choice "none": tools are shown to the model (the chat template), no
  call is read.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fleet.core.sampling_params import InvalidParameter, StructuredOutputsParams


@dataclass
class ToolCall:
    name: str
    arguments: str
    """The arguments as JSON text, as OpenAI returns them."""
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or f"chatcmpl-tool-{uuid.uuid4().hex}"

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


class ToolChoice:
    """A request's tools and tool_choice, checked against the server's flags."""

    def __init__(self, tools: list[dict[str, Any]] | None, choice: str | dict[str, Any] | None, parser: str | None,
                 auto_enabled: bool, parallel_calls: bool = True):
        self.tools = {tool["function"]["name"]: tool["function"] for tool in tools or []}
        self.parallel_calls = parallel_calls
        """parallel_tool_calls: false allows one call per reply."""
        self.choice = choice if choice is not None else ("auto" if self.tools else "none")
        self.parser = parser
        if isinstance(self.choice, dict):
            name = self.choice.get("function", {}).get("name")
            if name not in self.tools:
                raise InvalidParameter("tool_choice", f"tool_choice names function {name!r}, which is not in tools")
            self.choice = {"name": name}
        elif self.choice in ("required", "auto") and not self.tools:
            raise InvalidParameter("tool_choice", f'tool_choice "{self.choice}" needs tools')
        elif self.choice == "auto" and not auto_enabled:
            raise InvalidParameter(
                "tool_choice",
                '"auto" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser',
            )

    @property
    def forced(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, dict)

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint that makes a forced choice parse: the named
        function's arguments, or a list of {name, parameters} calls."""
        if isinstance(self.choice, dict):
            return StructuredOutputsParams(json=_parameters(self.tools[self.choice["name"]]))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _parameters(function)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, function in self.tools.items()
        ]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel_calls:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def content_prefix_length(self, text: str) -> int:
        """How much of a reply still being written is surely content (no tool call starts in it)."""
        if self.forced:
            return 0
        if self.choice != "auto":
            return len(text)
        return CONTENT_BEFORE_CALLS[self.parser](text)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content and its calls (the first only, without parallel calls)."""
        content, calls = self._parse(text)
        return content, calls if self.parallel_calls else calls[:1]

    def _parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if isinstance(self.choice, dict):
            return None, [ToolCall(self.choice["name"], _compact(text))]
        if self.choice == "required":
            return None, [ToolCall(call["name"], json.dumps(call["parameters"])) for call in _json_or_none(text) or []]
        if self.choice == "auto":
            return PARSERS[self.parser](text)
        return text, []


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def _compact(text: str) -> str:
    parsed = _json_or_none(text)
    return text if parsed is None else json.dumps(parsed)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:  # a reply cut by max_tokens
        return None


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> tuple[str | None, list[ToolCall]]:
    """<tool_call>{"name": ..., "arguments": {...}}</tool_call>, any number,
    anywhere in the text (Hermes, Qwen 2.5/3); the text around them is the content."""
    calls = []
    for match in HERMES_CALL.finditer(text):
        call = _json_or_none(match.group(1))
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}))))
    if not calls:
        return text, []
    content = HERMES_CALL.sub("", text).strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCall]]:
    """Llama 3's JSON calls: the reply is `{"name": ..., "parameters": {...}}`
    (optionally after <|python_tag|>), several separated by ";"."""
    body = text.strip().removeprefix(LLAMA3_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder, calls, position = json.JSONDecoder(), [], 0
    while position < len(body):
        try:
            call, position = decoder.raw_decode(body, position)
        except ValueError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        calls.append(ToolCall(call["name"], json.dumps(call.get("parameters", call.get("arguments", {})))))
        while position < len(body) and body[position] in " \t\n;":
            position += 1
    return None, calls


def hermes_content_length(text: str) -> int:
    """Up to the first <tool_call>, or up to a tail that may become one."""
    start = text.find(HERMES_START)
    if start >= 0:
        return start
    for keep in range(min(len(HERMES_START) - 1, len(text)), 0, -1):
        if HERMES_START.startswith(text[-keep:]):
            return len(text) - keep
    return len(text)


def llama3_content_length(text: str) -> int:
    """A Llama 3 call is the whole reply: nothing is content while the reply may still be one."""
    body = text.lstrip()
    may_be_call = body.startswith("{") or LLAMA3_TAG.startswith(body[: len(LLAMA3_TAG)])
    return 0 if may_be_call else len(text)


HERMES_START = "<tool_call>"
LLAMA3_TAG = "<|python_tag|>"
PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
"""--tool-call-parser: how a model writes calls in its text."""
CONTENT_BEFORE_CALLS = {"hermes": hermes_content_length, "llama3_json": llama3_content_length}
