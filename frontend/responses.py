"""OpenAI's Responses API over the chat completions machinery: a request is
translated into a chat request (frontend/responses_protocol.py), run as one,
and its reply returned as output items, whole or as the Responses event stream;
responses are stored (frontend/response_store.py) for retrieval, background
runs and `previous_response_id`."""
from __future__ import annotations

import asyncio
import copy
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fleet.core.sampling_params import InvalidParameter
from fleet.frontend.async_engine import ServerStopping
from fleet.frontend.engine_client import EngineDeadError
from fleet.frontend.output_processor import RequestOutput
from fleet.frontend.response_store import ResponseStore, StoredResponse, new_response_id
from fleet.frontend.responses_protocol import ResponsesRequest, items_to_messages
from fleet.frontend.serving import Prepared, RequestFailed, Serving, ToolCallStream
from fleet.frontend.tool_calls import ToolCall, ToolChoice

UNSERVED = (RequestFailed, EngineDeadError, ServerStopping)
"""Why an accepted response got no (complete) answer: a failure in the engine, a dead engine, the drain's end."""


@dataclass
class Turn:
    """One validated Responses request, ready to run."""

    request: ResponsesRequest
    response_id: str
    prepared: Prepared
    tools: ToolChoice
    conversation: list[dict[str, Any]]
    """The chat messages so far without the instructions: the previous response's, then this input's."""
    owner: str | None
    """Whose it is once stored (response_store.owner_of)."""


class ResponsesServing:
    def __init__(self, serving: Serving, store: ResponseStore, server_index: int, lookup):
        self.serving = serving
        self.store = store
        self.server_index = server_index
        self.lookup = lookup
        """async (response id, owner) -> StoredResponse | None, wherever the id's API server is."""

    # ---- preparing -------------------------------------------------------------------------

    async def prepare(self, request: ResponsesRequest, owner: str | None) -> Turn:
        """`owner`: the asking key's; another key's previous_response_id is as unknown as one never made."""
        history: list[dict[str, Any]] = []
        if request.previous_response_id is not None:
            previous = await self.lookup(request.previous_response_id, owner)
            if previous is None:
                raise InvalidParameter("previous_response_id", f"Previous response with id "
                                                               f"'{request.previous_response_id}' not found.")
            if previous.response["status"] in ("queued", "in_progress"):
                raise InvalidParameter("previous_response_id", f"response '{request.previous_response_id}' is "
                                                               "still running: wait until it completes")
            history = previous.conversation

        def build() -> Turn:
            chat = request.chat_request(history)
            prepared, tools = self.serving.prepare_chat(chat, None)
            conversation = history + items_to_messages(request.input_items())
            return Turn(request, new_response_id(self.server_index), prepared, tools, conversation, owner)

        return await asyncio.to_thread(build)

    # ---- answering ---------------------------------------------------------------------------

    async def create(self, turn: Turn) -> dict[str, Any]:
        """The whole response (stored unless store is false)."""
        if turn.request.background:
            return self._start_background(turn)
        output = await self.serving.run_to_end(turn.prepared, turn.request.priority)
        response = self._finished(turn, output, self._reply_items(turn, output))
        self._remember(turn, response)
        return response

    def _start_background(self, turn: Turn) -> dict[str, Any]:
        response = self._skeleton(turn, "queued")
        entry = StoredResponse(response, turn.conversation, turn.request.input_items(), turn.owner)
        entry.task = asyncio.create_task(self._run_in_background(turn, entry))
        self.store.put(entry)
        return copy.deepcopy(response)

    async def _run_in_background(self, turn: Turn, entry: StoredResponse) -> None:
        entry.response["status"] = "in_progress"
        try:
            output = await self.serving.run_to_end(turn.prepared, turn.request.priority)
            finished = self._finished(turn, output, self._reply_items(turn, output))
            entry.response.update(finished)
            entry.conversation = turn.conversation + [_assistant_message(finished["output"])]
        except asyncio.CancelledError:
            entry.response["status"] = "cancelled"
        except Exception as error:  # noqa: BLE001 - whatever ended it, the stored response says so
            entry.response.update(status="failed", error={"code": "server_error", "message": _failure(error)})
        finally:
            entry.task = None
            self.store.update(turn.response_id)

    def _remember(self, turn: Turn, response: dict[str, Any]) -> None:
        if turn.request.store:
            conversation = turn.conversation + [_assistant_message(response["output"])]
            self.store.put(StoredResponse(copy.deepcopy(response), conversation, turn.request.input_items(),
                                          turn.owner))

    async def stream(self, turn: Turn) -> AsyncIterator[str]:
        """The Responses event stream; the response is stored at its end."""
        events = _EventStream()
        response = self._skeleton(turn, "in_progress")
        yield events.emit("response.created", response=response)
        yield events.emit("response.in_progress", response=response)
        message = _StreamedMessage(events)
        text = ToolCallStream(turn.tools)
        outputs: list[RequestOutput] = []
        try:
            async for sequence, _new, _first, _end, _output in self.serving.sequence_updates(
                    turn.prepared, turn.request.priority, outputs):
                deltas, calls = text.advance(sequence)
                for delta in deltas:
                    if delta.get("content"):
                        for event in message.add(delta["content"]):
                            yield event
        except UNSERVED as error:
            failed = {**response, "status": "failed", "error": {"code": "server_error", "message": _failure(error)}}
            yield events.emit("error", code="server_error", message=_failure(error), param=None)
            yield events.emit("response.failed", response=failed)
            return
        output = outputs[0]
        items = []
        if message.opened or not calls:
            for event in message.close():
                yield event
            items.append(message.item)
        for call in calls:
            item = _function_call_item(call)
            for event in _stream_function_call(events, len(items), item):
                yield event
            items.append(item)
        finished = self._finished(turn, output, items)
        self._remember(turn, finished)
        # Even when cut by max_output_tokens (status "incomplete"), as vLLM does: the SDK's stream helpers
        # take their final response from response.completed only.
        yield events.emit("response.completed", response=finished)

    # ---- response objects --------------------------------------------------------------------

    @staticmethod
    def _reply_items(turn: Turn, output: RequestOutput) -> list[dict[str, Any]]:
        """The output items of a whole reply: its text as a message (unless it is only calls), then its calls."""
        content, calls = turn.tools.parse(output.outputs[0].text)
        items = [] if calls and not content else [_message_item(_item_id("msg"), content or "", "completed")]
        return items + [_function_call_item(call) for call in calls]

    def _skeleton(self, turn: Turn, status: str) -> dict[str, Any]:
        """The response object before its output exists."""
        request, params = turn.request, turn.prepared.params
        return {
            "id": turn.response_id, "object": "response", "created_at": int(time.time()), "status": status,
            "background": request.background, "error": None, "incomplete_details": None,
            "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
            "model": self.serving.answered_name(request), "output": [],
            "parallel_tool_calls": request.parallel_tool_calls, "previous_response_id": request.previous_response_id,
            "temperature": params.temperature, "top_p": params.top_p,
            "text": {"format": (request.text.format.model_dump(by_alias=True, exclude_none=True)
                                if request.text else {"type": "text"})},
            "tool_choice": request.tool_choice or ("auto" if request.tools else "none"),
            "tools": request.tools or [], "truncation": "disabled", "usage": None, "user": request.user,
            "metadata": request.metadata or {}, "store": request.store,
        }

    def _finished(self, turn: Turn, output: RequestOutput, items: list[dict[str, Any]]) -> dict[str, Any]:
        response = self._skeleton(turn, "completed")
        sequence = output.outputs[0]
        if sequence.finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        prompt, completion = len(output.prompt_token_ids), len(sequence.token_ids)
        response["output"] = items
        response["usage"] = {"input_tokens": prompt,
                             "input_tokens_details": {"cached_tokens": output.num_cached_tokens or 0},
                             "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                             "total_tokens": prompt + completion}
        return response


class _EventStream:
    """Server-sent events of one response, numbered in order."""

    def __init__(self):
        self.sequence_number = 0

    def emit(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


class _StreamedMessage:
    """The assistant's message item of a stream: opened at its first text."""

    def __init__(self, events: _EventStream):
        self.events = events
        self.item = _message_item(_item_id("msg"), "", "in_progress")
        self.opened = False
        self.text = ""

    def add(self, delta: str) -> list[str]:
        out = [] if self.opened else self._open()
        self.text += delta
        out.append(self.events.emit("response.output_text.delta", item_id=self.item["id"], output_index=0,
                                    content_index=0, delta=delta, logprobs=[]))
        return out

    def close(self) -> list[str]:
        out = [] if self.opened else self._open()
        part = _text_part(self.text)
        self.item = _message_item(self.item["id"], self.text, "completed")
        where = {"item_id": self.item["id"], "output_index": 0, "content_index": 0}
        out.append(self.events.emit("response.output_text.done", **where, text=self.text, logprobs=[]))
        out.append(self.events.emit("response.content_part.done", **where, part=part))
        out.append(self.events.emit("response.output_item.done", output_index=0, item=self.item))
        return out

    def _open(self) -> list[str]:
        self.opened = True
        return [self.events.emit("response.output_item.added", output_index=0, item=self.item),
                self.events.emit("response.content_part.added", item_id=self.item["id"], output_index=0,
                                 content_index=0, part=_text_part(""))]


def _stream_function_call(events: _EventStream, index: int, item: dict[str, Any]) -> list[str]:
    started = {**item, "arguments": "", "status": "in_progress"}
    return [
        events.emit("response.output_item.added", output_index=index, item=started),
        events.emit("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"]),
        events.emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    name=item["name"], arguments=item["arguments"]),
        events.emit("response.output_item.done", output_index=index, item=item),
    ]


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [_text_part(text)]}


def _function_call_item(call: ToolCall) -> dict[str, Any]:
    return {"id": _item_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": call.arguments, "status": "completed"}


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output items as the assistant's chat message (continued by previous_response_id)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message


def _failure(error: Exception) -> str:
    if isinstance(error, RequestFailed):
        return f"the request failed in the engine: {error}"
    return str(error)
