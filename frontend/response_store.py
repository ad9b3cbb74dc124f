"""The Responses API's stored responses: what `GET /v1/responses/{id}` returns
and what `previous_response_id` continues from. Each API server keeps its
own, bounded by count and by bytes (oldest evicted first); a response's id
names the API server that holds it (frontend/response_peers.py asks that one).
With --api-key a response belongs to the key that made it: another key finds
no response of that id, and cannot evict it by storing its own."""
from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


def new_response_id(server_index: int) -> str:
    """`resp_<32 hex digits>_<API server index>`."""
    return f"resp_{uuid.uuid4().hex}_{server_index}"


def owner_of(authorization: str, api_keys: list[str] | None) -> str | None:
    """Whose stored responses a request makes and may see: the sha256 of its
    `Authorization: Bearer KEY` (read as the gatekeeper reads it, which has
    checked it), so that the store never holds a key; None without --api-key,
    where all clients share one store as before."""
    if not api_keys:
        return None
    _, _, key = authorization.partition(" ")
    return hashlib.sha256(key.strip().encode()).hexdigest()


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
    owner: str | None = None
    """The sha256 of the API key that made it (owner_of); None without --api-key."""
    task: asyncio.Task | None = field(default=None, repr=False)
    """A background response's generation, while it runs."""
    size: int = 0

    def measure(self) -> int:
        self.size = sum(len(json.dumps(part, ensure_ascii=False)) for part in
                        (self.response, self.conversation, self.input_items))
        return self.size


class ResponseStore:
    """Responses by id, each its owner's; per owner oldest first. An owner
    keeps at most `max_per_owner` responses (its own oldest go first, so a
    flood of one key's responses evicts only that key's), and all owners
    together at most `max_bytes` of JSON: past that, the oldest response of
    the owner holding the most bytes goes. Evicting a background response
    that still runs cancels it (its answer would have nowhere to go)."""

    def __init__(self, max_per_owner: int, max_bytes: int):
        self.max_per_owner = max_per_owner
        self.max_bytes = max_bytes
        self.entries: dict[str, StoredResponse] = {}
        self.holdings: dict[str | None, Holding] = {}
        self.bytes = 0

    def put(self, entry: StoredResponse) -> None:
        response_id = entry.response["id"]
        self.remove(response_id)
        if entry.measure() > self.max_bytes:
            logger.warning("response %s (%d bytes) is larger than --max-stored-response-bytes: not stored",
                           response_id, entry.size)
            return
        holding = self.holdings.setdefault(entry.owner, Holding())
        self.entries[response_id] = entry
        holding.ids[response_id] = None
        holding.bytes += entry.size
        self.bytes += entry.size
        while len(holding.ids) > self.max_per_owner:
            self._evict(next(iter(holding.ids)))
        self._keep_within_bytes()

    def update(self, response_id: str) -> None:
        """Re-measure an entry whose response changed (a background one that finished)."""
        entry = self.entries.get(response_id)
        if entry is None:
            return
        old = entry.size
        grown = entry.measure() - old
        self.holdings[entry.owner].bytes += grown
        self.bytes += grown
        self._keep_within_bytes()

    def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        """`owner`'s response of that id; None also when another owner's holds it (its existence does not leak)."""
        entry = self.entries.get(response_id)
        return entry if entry is not None and entry.owner == owner else None

    def remove(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.pop(response_id, None)
        if entry is not None:
            holding = self.holdings[entry.owner]
            del holding.ids[response_id]
            holding.bytes -= entry.size
            self.bytes -= entry.size
            if not holding.ids:
                del self.holdings[entry.owner]
        return entry

    def _keep_within_bytes(self) -> None:
        while self.bytes > self.max_bytes:
            largest = max(self.holdings.values(), key=lambda holding: holding.bytes)
            self._evict(next(iter(largest.ids)))

    def _evict(self, response_id: str) -> None:
        entry = self.remove(response_id)
        if entry is not None and entry.task is not None and not entry.task.done():
            logger.warning("background response %s evicted from the store while it ran: cancelled", response_id)
            entry.task.cancel()


@dataclass
class Holding:
    """One owner's part of the store."""

    ids: dict[str, None] = field(default_factory=dict)
    """Its responses' ids, oldest first."""
    bytes: int = 0
