"""What every HTTP request passes before a route: the API key, the body size
limit, OpenAI-shaped errors, and the header naming the answering API server.

A pure ASGI middleware, not `@app.middleware("http")`: Starlette's HTTP
middleware hands routes a receive channel of its own, on which a client's
disconnect never arrives, so a non-streaming request whose client gave up
would run to its end.
"""
from __future__ import annotations

import hashlib
import hmac
import logging

from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
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

OPEN_PATHS = frozenset({"/health", "/ping"})
"""What a load balancer polls: open whatever --api-key says. Every other path
needs the key, unknown ones too (an allow-list: a route added later is guarded)."""
METRICS_PATH = "/metrics"
"""Open too, for scrapers, unless --metrics-require-key."""


class BodyTooLarge(HTTPException):
    """The body grew past --max-request-body-bytes while being read (no
    Content-Length). An HTTPException, which FastAPI passes on from reading a
    body (any other error there becomes its 400 "error parsing the body")."""

    def __init__(self, limit: int):
        super().__init__(413, _too_large_message(limit))


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def authorized(headers: Headers, key_digests: list[bytes]) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235), KEY one
    of the keys whose sha256 is in `key_digests`. Digests of equal length are
    compared in constant time, so neither a key's length nor its prefix leaks."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    given = key_digest(key.strip())
    matches = [hmac.compare_digest(given, digest) for digest in key_digests]  # every one: no early exit
    return scheme.lower() == "bearer" and any(matches)


def open_path_spelling(scope: Scope) -> str:
    """The path without --root-path, lower case, repeated and trailing slashes
    dropped: every spelling of an open path reads as that path. Safe because
    no guarded route matches any spelling of /health, /ping or /metrics: the
    router strips the root path as done here and is case-sensitive (`/HEALTH`
    is a 404). Dot segments are not resolved: `/v1/models/../../health` is a
    guarded route (`/v1/models/{name:path}`), not /health."""
    path = scope["path"].lower()
    root = scope.get("root_path", "").lower().rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):]
    return "/" + "/".join(part for part in path.split("/") if part)


def _too_large_message(limit: int) -> str:
    return f"the request body is larger than {limit} bytes (--max-request-body-bytes)"


def too_large(limit: int) -> JSONResponse:
    return error_response(413, _too_large_message(limit))


class Gatekeeper:
    def __init__(self, app: ASGIApp, api_keys: list[str] | None, server_index: int, max_body_bytes: int,
                 metrics_require_key: bool):
        self.app = app
        self.key_digests = [key_digest(key) for key in api_keys or []]
        self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS | {METRICS_PATH}
        self.server_header = (b"fleet-api-server", str(server_index).encode())
        self.max_body_bytes = max_body_bytes

    def needs_key(self, scope: Scope) -> bool:
        return bool(self.key_digests) and open_path_spelling(scope) not in self.open_paths

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
        if self.needs_key(scope) and not authorized(headers, self.key_digests):
            response = error_response(401, "invalid or missing API key: send `Authorization: Bearer KEY`")
            response.headers["www-authenticate"] = "Bearer"
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
                    raise BodyTooLarge(self.max_body_bytes)
            return message

        return counted
