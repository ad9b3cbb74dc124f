"""`fleet proxy`: prefill/decode disaggregation in front of separate fleet
instances (other launches, other machines).

Each completion or chat request goes first to a prefill instance (one started
with --kv-transfer-config kv_role kv_producer), as the same request cut to one
token with `kv_transfer_params: {"do_remote_decode": true}`; its answer says
where the prompt's KV waits. Then the original request goes to a decode
instance (kv_consumer) with those params: the decode instance pulls the KV
instead of computing the prompt, and its answer (streamed or not) is relayed
as it comes. This is how vLLM's disaggregated-prefill proxies drive it.

Faults: a prefill instance that refuses the connection, fails or dies is
marked down for DOWN_S and the next one is tried; with none left the request
goes to a decode instance without params, which computes the prompt itself.
A transfer that fails on the decode side falls back the same way there
(core/kv_connector.py). A client error (4xx) from a prefill instance is the
answer: the decode instance would refuse the request alike.

Trust: the instances take kv_transfer_params only with the secret of their
--kv-transfer-config, which the proxy adds (--kv-transfer-secret) to the
requests it builds; a client's own kv_transfer_params are a 400 here, and a
client's copy of the secret header is dropped (frontend/kv_transfer_gate.py).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fleet.frontend.kv_transfer_gate import SECRET_HEADER

logger = logging.getLogger("fleet.proxy")

DOWN_S = 5.0
"""How long an instance that failed is tried only after the others."""
CONNECT_TIMEOUT_S = 5.0
DISAGGREGATED_PATHS = ("/v1/completions", "/v1/chat/completions")
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive", SECRET_HEADER}
"""Headers not forwarded as the client sent them (the secret header only the proxy writes)."""


class Instances:
    """Instances of one kind, tried in rotation; those that failed recently go last."""

    def __init__(self, kind: str, urls: list[str]):
        self.kind = kind
        self.urls = [url.rstrip("/") for url in urls]
        self._down_until = dict.fromkeys(self.urls, 0.0)
        self._next = itertools.count()

    def in_order(self) -> list[str]:
        start = next(self._next) % len(self.urls)
        rotation = self.urls[start:] + self.urls[:start]
        now = time.monotonic()
        return sorted(rotation, key=lambda url: self._down_until[url] > now)  # stable: rotation among equals

    def failed(self, url: str, why: str) -> None:
        logger.warning("%s instance %s failed: %s", self.kind, url, why)
        self._down_until[url] = time.monotonic() + DOWN_S

    def answered(self, url: str) -> None:
        self._down_until[url] = 0.0


class DisaggregationProxy:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], kv_transfer_secret: str):
        if not prefill_urls or not decode_urls:
            raise ValueError("fleet proxy needs at least one --prefill URL and one --decode URL")
        self.kv_transfer_secret = kv_transfer_secret
        self.prefill = Instances("prefill", prefill_urls)
        self.decode = Instances("decode", decode_urls)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S))
        self.num_prefilled = 0
        """Requests whose prompt a prefill instance computed."""
        self.num_fallbacks = 0
        """Requests that went to a decode instance without a prefill (none answered)."""

    async def disaggregated(self, path: str, request: Request) -> Response:
        try:
            body = json.loads(await request.body())
        except ValueError as error:
            return _error(400, f"the body is not JSON: {error}")
        if not isinstance(body, dict):
            return _error(400, "the body must be a JSON object")
        if body.get("kv_transfer_params") is not None:
            return _error(400, "kv_transfer_params are the proxy's to write, not a client's", "kv_transfer_params")
        headers = {**_forwarded_headers(request), SECRET_HEADER: self.kv_transfer_secret}
        params = None
        if _prefills_apart(body):
            prefill = await self._prefill(path, body, headers)
            if isinstance(prefill, Response):
                return prefill
            params = prefill
        if params is not None:
            self.num_prefilled += 1
            body = {**body, "kv_transfer_params": params}
        else:
            self.num_fallbacks += 1
        return await self._to_decode("POST", path, headers, body, request.url.query)

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | Response | None:
        """The KV params of the prompt computed by a prefill instance; an error Response to return
        as it is (the client's mistake); None when no prefill instance could do it."""
        cut = {**body, "max_tokens": 1, "min_tokens": 0, "n": 1, "stream": False,
               "kv_transfer_params": {"do_remote_decode": True}}
        cut.pop("stream_options", None)
        if "max_completion_tokens" in cut:
            cut["max_completion_tokens"] = 1
        for url in self.prefill.in_order():
            try:
                answer = await self.client.post(url + path, json=cut, headers=headers)
            except httpx.HTTPError as error:
                self.prefill.failed(url, f"{type(error).__name__}: {error}")
                continue
            if 400 <= answer.status_code < 500:
                return Response(answer.content, answer.status_code, media_type="application/json")
            if answer.status_code != 200:
                self.prefill.failed(url, f"HTTP {answer.status_code}: {answer.text[:200]}")
                continue
            self.prefill.answered(url)
            return answer.json().get("kv_transfer_params")
        logger.warning("no prefill instance answered: the decode instance computes the prompt")
        return None

    async def passthrough(self, path: str, request: Request) -> Response:
        """Every other route (models, embeddings, tokenize, ...) as a decode instance answers it."""
        body = await request.body()
        return await self._to_decode(request.method, path, _forwarded_headers(request), body, request.url.query)

    async def _to_decode(self, method: str, path: str, headers: dict, body, query: str) -> Response:
        content = json.dumps(body).encode() if isinstance(body, dict) else body
        headers = {**headers, "content-type": "application/json"} if isinstance(body, dict) else headers
        for url in self.decode.in_order():
            target = url + path + (f"?{query}" if query else "")
            upstream = self.client.build_request(method, target, headers=headers, content=content)
            try:
                answer = await self.client.send(upstream, stream=True)
            except httpx.HTTPError as error:
                self.decode.failed(url, f"{type(error).__name__}: {error}")
                continue
            self.decode.answered(url)
            return StreamingResponse(_relay(answer), answer.status_code, media_type=answer.headers.get("content-type"))
        return _error(503, "no decode instance answered")

    async def health(self) -> Response:
        """200 while some decode instance is healthy (prefill instances are optional: decode falls back)."""
        for url in self.decode.urls:
            try:
                if (await self.client.get(url + "/health", timeout=2.0)).status_code == 200:
                    return Response(status_code=200)
            except httpx.HTTPError:
                continue
        return _error(503, "no decode instance is healthy")

    async def close(self) -> None:
        await self.client.aclose()


async def _relay(answer: httpx.Response):
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    finally:
        await answer.aclose()


def _prefills_apart(body: dict) -> bool:
    """Whether a prefill instance can compute this request's prompt for the decode one: one prompt
    (a list of prompts gets one KV per prompt, which one answer cannot carry), and no prompt logprobs
    (the decode instance must compute every prompt position for them)."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
    return not several and body.get("prompt_logprobs") is None


def _forwarded_headers(request: Request) -> dict[str, str]:
    return {name: value for name, value in request.headers.items() if name.lower() not in HOP_HEADERS}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def build_proxy_app(proxy: DisaggregationProxy) -> FastAPI:
    app = FastAPI(title="fleet proxy", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        return await proxy.health()

    @app.get("/proxy/stats")
    async def stats() -> dict:
        return {"prefilled": proxy.num_prefilled, "fallbacks": proxy.num_fallbacks}

    for path in DISAGGREGATED_PATHS:
        app.add_api_route(path, _route(proxy, path), methods=["POST"])

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE"])
    async def other(path: str, request: Request) -> Response:
        return await proxy.passthrough("/" + path, request)

    @app.on_event("shutdown")
    async def close() -> None:
        await proxy.close()

    return app


def _route(proxy: DisaggregationProxy, path: str):
    async def handler(request: Request) -> Response:
        return await proxy.disaggregated(path, request)

    return handler


def proxy_parser() -> argparse.ArgumentParser:
    from fleet.config.cli_args import OneLineErrorParser

    parser = OneLineErrorParser(prog="fleet proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                        help="Prefill instances (launched with --kv-transfer-config '{\"kv_role\": \"kv_producer\"}').")
    parser.add_argument("--decode", nargs="+", required=True, metavar="URL",
                        help="Decode instances (launched with --kv-transfer-config '{\"kv_role\": \"kv_consumer\"}').")
    parser.add_argument("--kv-transfer-secret", required=True, metavar="SECRET",
                        help="The secret of the instances' --kv-transfer-config (kv_connector_extra_config secret): "
                             "they take kv_transfer_params only with it.")
    parser.add_argument("--host", default="127.0.0.1", help="Address to serve on.")
    parser.add_argument("--port", type=int, default=8000, help="Port to serve on (0: a free one, logged).")
    return parser


def main(argv: list[str]) -> int:
    args = proxy_parser().parse_args(argv)
    for url in [*args.prefill, *args.decode]:
        if not url.startswith(("http://", "https://")):
            proxy_parser().error(f"--prefill/--decode take URLs such as http://host:port, got {url!r}")
    from fleet.core.launch.processes import log_as

    log_as("fleet-proxy")
    serve(DisaggregationProxy(args.prefill, args.decode, args.kv_transfer_secret), args.host, args.port)
    return 0


def serve(proxy: DisaggregationProxy, host: str, port: int, ready=None) -> None:
    """Serve until SIGINT/SIGTERM; `ready(url)` is called once listening."""
    import uvicorn

    from fleet.core.ipc import listening_socket

    listener = listening_socket(host, port)
    server = uvicorn.Server(uvicorn.Config(build_proxy_app(proxy), log_level="warning"))
    url = f"http://{host}:{listener.getsockname()[1]}"

    async def run() -> None:
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            logger.info("serving prefill %s, decode %s on %s", proxy.prefill.urls, proxy.decode.urls, url)
            if ready is not None:
                ready(url)
        await task

    asyncio.run(run())
