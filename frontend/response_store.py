"""The Responses API's stored responses: what `GET /v1/responses/{id}` returns
and what `previous_response_id` continues from. Each API server keeps its
own, bounded by count and by bytes (oldest evicted first); a response's id
names the API server that holds it (frontend/response_peers.py asks that one)."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def new_response_id(server_index: int) -> str:
    """`resp_<32 hex digits>_<API server index>`."""
    return f"resp_{uuid.uuid4().hex}_{server_index}"


def holder_of(response_id: str) -> int | None:
    """The index of the API server that holds `response_id`, None for an id no server made."""
    prefix, _, index = response_id.rpartition("_")
    if not prefix.startswith("resp_") or not index.isdigit() or len(index) > 6:
        return None
    return int(index)


@dataclass
class StoredResponse:
    response: dict[str, Any]
    """The response object as the API returns it (updated in place while a background one runs)."""
    conversation: list[dict[str, Any]]
    """The chat messages that a response continuing from this one starts with: its input, then its output."""
    input_items: list[dict[str, Any]]
    """Its input as Responses items (GET /v1/responses/{id}/input_items)."""
    task: asyncio.Task | None = field(default=None, repr=False)
    """A background response's generation, while it runs."""
    size: int = 0

    def measure(self) -> int:
        self.size = sum(len(json.dumps(part, ensure_ascii=False)) for part in
                        (self.response, self.conversation, self.input_items))
        return self.size


class ResponseStore:
    """Responses by id, oldest first; at most `max_count` of them and
    `max_bytes` of their JSON. Evicting a background response that still
    runs cancels it (its answer would have nowhere to go)."""

    def __init__(self, max_count: int, max_bytes: int):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.bytes = 0

    def put(self, entry: StoredResponse) -> None:
        response_id = entry.response["id"]
        self.remove(response_id)
        if entry.measure() > self.max_bytes:
            logger.warning("response %s (%d bytes) is larger than --max-stored-response-bytes: not stored",
                           response_id, entry.size)
            return
        self.entries[response_id] = entry
        self.bytes += entry.size
        while len(self.entries) > self.max_count or self.bytes > self.max_bytes:
            oldest = next(iter(self.entries))
            self._evict(oldest)

    def update(self, response_id: str) -> None:
        """Re-measure an entry whose response changed (a background one that finished)."""
        entry = self.entries.get(response_id)
        if entry is None:
            return
        self.bytes -= entry.size
        self.bytes += entry.measure()
        while self.bytes > self.max_bytes and self.entries:
            self._evict(next(iter(self.entries)))

    def get(self, response_id: str) -> StoredResponse | None:
        return self.entries.get(response_id)

    def remove(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def _evict(self, response_id: str) -> None:
        entry = self.remove(response_id)
        if entry is not None and entry.task is not None and not entry.task.done():
            logger.warning("background response %s evicted from the store while it ran: cancelled", response_id)
            entry.task.cancel()
