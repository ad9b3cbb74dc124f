"""What every HTTP request passes before a route: the API key, the body size
limit, OpenAI-shaped errors, and the header naming the answering API server.

A pure ASGI middleware, not `@app.middleware("http")`: Starlette's HTTP
middleware hands routes a receive channel of its own, on which a client's
disconnect never arrives, so a non-streaming request whose client gave up
would run to its end.
"""
from __future__ import annotations

import hmac
import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    503: "ServiceUnavailableError",
}


class BodyTooLarge(Exception):
    """The body grew past --max-request-body-bytes while being read (no Content-Length)."""


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def authorized(headers: Headers, api_keys: list[str]) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235), KEY one
    of `api_keys`, compared in constant time so its length and prefix do not leak."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    given = key.strip().encode()
    matches = [hmac.compare_digest(given, api_key.encode()) for api_key in api_keys]  # every one: no early exit
    return scheme.lower() == "bearer" and any(matches)


def too_large(limit: int) -> JSONResponse:
    return error_response(413, f"the request body is larger than {limit} bytes (--max-request-body-bytes)")


class Gatekeeper:
    def __init__(self, app: ASGIApp, api_keys: list[str] | None, server_index: int, max_body_bytes: int):
        self.app = app
        self.api_keys = api_keys
        self.server_header = (b"fleet-api-server", str(server_index).encode())
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_named(message: Message) -> None:
            # Several API servers share the port: say which one answered (and whose /metrics these are).
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), self.server_header]
            await send(message)

        headers = Headers(scope=scope)
        if self.api_keys and scope["path"].startswith("/v1") and not authorized(headers, self.api_keys):
            response = error_response(401, "invalid or missing API key: send `Authorization: Bearer KEY`")
            await response(scope, receive, send_named)
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await too_large(self.max_body_bytes)(scope, receive, send_named)
            return
        try:
            await self.app(scope, self._counting(receive), send_named)
        except Exception as error:  # a bug of ours: still OpenAI's shape, and the connection stays open
            logger.exception("%s %s failed", scope.get("method"), scope["path"])
            if not started:
                response = error_response(500, f"internal error: {type(error).__name__}: {error}")
                await response(scope, receive, send_named)

    def _counting(self, receive: Receive) -> Receive:
        """`receive` that raises BodyTooLarge once the body passes the limit."""
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise BodyTooLarge
            return message

        return counted
