"""Stored responses across the API servers of one launch. They share one
listening socket, so a `GET /v1/responses/{id}` (or a `previous_response_id`)
lands on any of them; the id names the server that stored it
(response_store.holder_of), and the others ask that one over ZMQ. Each API
server answers such questions on its own ipc:// address, from its store;
a question carries the asking key's owner, so that the holder refuses
another key's as it does on its own requests."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal

import msgspec
import zmq
import zmq.asyncio

from fleet.frontend.response_store import ResponseStore, StoredResponse, holder_of

logger = logging.getLogger(__name__)

PEER_TIMEOUT_S = 5.0
"""How long a question to another API server may take before the request gets a 503."""


class StoreQuestion(msgspec.Struct, frozen=True):
    action: Literal["get", "delete", "cancel"]
    response_id: str
    owner: str | None
    """Whose response it must be (response_store.owner_of): the holder checks, as for its own requests."""


class StoredEntry(msgspec.Struct):
    """A stored response as it crosses between API servers."""

    response: dict[str, Any]
    conversation: list[dict[str, Any]]
    input_items: list[dict[str, Any]]


class StoreAnswer(msgspec.Struct):
    entry: StoredEntry | None
    """None: the asked server holds no response of that id."""


class PeerUnreachable(Exception):
    """The API server holding a response did not answer (HTTP 503)."""


class ResponsePeers:
    """This API server's part: its store, answered on `addresses[index]`,
    and questions to the others' stores."""

    def __init__(self, index: int, addresses: list[str], store: ResponseStore):
        self.index = index
        self.addresses = addresses
        self.store = store
        self.context = zmq.asyncio.Context.instance()
        self.answering: asyncio.Task | None = None

    def start(self) -> None:
        """Answer the other API servers (only when there are others)."""
        if len(self.addresses) > 1 and self.answering is None:
            self.answering = asyncio.create_task(self._answer())

    async def stop(self) -> None:
        if self.answering is not None:
            self.answering.cancel()
            await asyncio.gather(self.answering, return_exceptions=True)

    async def act(self, action: str, response_id: str, owner: str | None) -> StoredResponse | None:
        """Get, delete or cancel `owner`'s stored response wherever it is; None
        when no server holds it, or holds it for another owner."""
        holder = holder_of(response_id)
        if holder is None or holder >= len(self.addresses):
            return None
        if holder == self.index:
            return await act_on_store(self.store, action, response_id, owner)
        answer = await self._ask(holder, StoreQuestion(action, response_id, owner))
        if answer.entry is None:
            return None
        return StoredResponse(answer.entry.response, answer.entry.conversation, answer.entry.input_items, owner)

    async def get(self, response_id: str, owner: str | None) -> StoredResponse | None:
        return await self.act("get", response_id, owner)

    async def _ask(self, holder: int, question: StoreQuestion) -> StoreAnswer:
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.connect(self.addresses[holder])
            await socket.send(msgspec.msgpack.encode(question))
            if not await socket.poll(PEER_TIMEOUT_S * 1000, zmq.POLLIN):
                raise PeerUnreachable(f"API server {holder}, which holds response {question.response_id}, "
                                      f"did not answer within {PEER_TIMEOUT_S:g} s")
            return msgspec.msgpack.decode(await socket.recv(), type=StoreAnswer)
        finally:
            socket.close()

    async def _answer(self) -> None:
        socket = self.context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.addresses[self.index])
        decoder = msgspec.msgpack.Decoder(StoreQuestion)
        try:
            while True:
                identity, payload = await socket.recv_multipart()
                try:
                    question = decoder.decode(payload)
                except msgspec.DecodeError:
                    logger.warning("ignoring a malformed stored-response question")
                    continue
                entry = await act_on_store(self.store, question.action, question.response_id, question.owner)
                wire = None if entry is None else StoredEntry(entry.response, entry.conversation, entry.input_items)
                await socket.send_multipart([identity, msgspec.msgpack.encode(StoreAnswer(wire))])
        finally:
            socket.close()


async def act_on_store(store: ResponseStore, action: str, response_id: str,
                       owner: str | None) -> StoredResponse | None:
    """Get, delete or cancel (a running background response) `owner`'s response in this server's store."""
    entry = store.get(response_id, owner)
    if entry is None:
        return None
    if action == "delete":
        store.remove(response_id)
    if action in ("delete", "cancel") and entry.task is not None:
        task = entry.task
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)  # its status says cancelled once this returns
    return entry
