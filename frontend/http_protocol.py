"""The HTTP/1.1 connection as uvicorn runs it, with what uvicorn lacks against
slow and numerous clients: a deadline for each request's head, and a cap on
the connections one API server serves.

uvicorn times out only an idle kept-alive connection (`timeout_keep_alive`):
a client that connects and sends nothing, or sends a head a byte at a time
(slowloris), holds its connection for ever. Its `limit_concurrency` answers
503 in plain text and keeps reading from every connection it accepted. Here
a connection past --max-connections is answered 503 in OpenAI's shape as
soon as its head is in, and closed; it too gets only the head deadline.

Built on uvicorn's h11 protocol (what uvicorn runs when httptools is not
installed): the head is complete when h11 hands over a request, which is
when uvicorn starts a new request-response cycle.
"""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from fleet.frontend.gatekeeper import error_body, error_response

logger = logging.getLogger(__name__)


class GuardedH11Protocol(H11Protocol):
    """One connection. uvicorn constructs it with its own keywords: the two
    limits are bound in by `guarded_protocol`."""

    def __init__(self, *args, header_timeout: float, max_connections: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self.max_connections = max_connections
        self.head_deadline: asyncio.TimerHandle | None = None
        self.cycle_before_head = None
        """The request-response cycle current when the deadline was set: a new one means the head is in."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # this one is counted
            if len(self.connections) == self.max_connections + 1:  # once as the cap is passed, not per connection
                logger.warning("%d HTTP connections open (--max-connections): answering new ones 503",
                               self.max_connections)
            self.app = over_capacity(self.max_connections)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.head_deadline is not None and self.cycle is not self.cycle_before_head:
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        # Before uvicorn's own, which handles a pipelined next request at once (and so may cancel this).
        if not self.transport.is_closing():
            self._await_head()
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1, or a head past h11's
        16 KiB: in OpenAI's shape, as every error fleet sends."""
        body = json.dumps(error_body(400, msg)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _await_head(self) -> None:
        self._cancel_head_deadline()
        self.cycle_before_head = self.cycle
        self.head_deadline = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _cancel_head_deadline(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
            self.head_deadline = None

    def _head_timed_out(self) -> None:
        self.head_deadline = None
        if self.transport.is_closing():
            return
        logger.debug("closing a connection whose request head took over %g s (--http-header-timeout)",
                     self.header_timeout)
        try:
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # h11 is mid-response: nothing it could say now
            pass
        self.transport.close()


def guarded_protocol(header_timeout: float, max_connections: int):
    """What uvicorn.Config takes as `http`: a callable that makes a GuardedH11Protocol."""

    def make(*args, **kwargs) -> GuardedH11Protocol:
        return GuardedH11Protocol(*args, header_timeout=header_timeout, max_connections=max_connections, **kwargs)

    return make


def over_capacity(max_connections: int):
    """The ASGI app a connection past the cap runs instead of fleet's: a 503 that closes it."""

    async def refuse(scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(503, f"this API server has {max_connections} connections open "
                                       "(--max-connections): try again later")
        response.headers["connection"] = "close"
        await response(scope, receive, send)

    return refuse
