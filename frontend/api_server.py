"""The API server process: FastAPI routes over an AsyncEngine.

Errors always have OpenAI's shape `{"error": {"message", "type", "param",
"code"}}`: 400 for bad parameters and malformed JSON, 401 for a wrong key,
404 for an unknown model, 413 for a body over --max-request-body-bytes, 500
when a request failed in the engine (or in our code), 503 when the engine is
dead. Tokenising and chat templating run on threads, off the event loop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
from http import HTTPStatus

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import fleet
from fleet.config.fleet import FleetConfig
from fleet.core.launch import processes
from fleet.core.launch.launcher import APIServerStartupInfo
from fleet.core.messages import Ready
from fleet.core.sampling_params import InvalidParameter
from fleet.frontend.async_engine import AsyncEngine, ServerStopping
from fleet.frontend.engine_client import EngineDeadError
from fleet.frontend.gatekeeper import Gatekeeper, error_body, error_response
from fleet.frontend.http_protocol import guarded_protocol
from fleet.frontend.kv_transfer_gate import check_kv_transfer_params
from fleet.frontend.metrics import Metrics
from fleet.frontend.openapi_errors import document_fleet_errors
from fleet.frontend.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    now,
)
from fleet.frontend.response_peers import PeerUnreachable, ResponsePeers
from fleet.frontend.response_store import ResponseStore, owner_of
from fleet.frontend.responses import ResponsesServing
from fleet.frontend.responses_protocol import ResponsesRequest
from fleet.frontend.sandbox import Sandbox, startup_info
from fleet.frontend.serving import RequestFailed, Serving

logger = logging.getLogger(__name__)

DRAIN_CUT_MARGIN_S = 1.0
"""Requests still running this long before the end of the drain are ended with an error."""
EXIT_MARGIN_S = 4.0
"""The process ends this long after the drain whatever its threads still do."""


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def build_app(engine: AsyncEngine, config: FleetConfig, sandbox: Sandbox, response_store_addresses: list[str]) -> FastAPI:
    """`response_store_addresses`: where each API server of this launch answers for its stored responses."""
    store = ResponseStore(config.frontend.max_stored_responses, config.frontend.max_stored_response_bytes)
    peers = ResponsePeers(engine.client_index, response_store_addresses, store)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        peers.start()
        yield
        await peers.stop()

    frontend = config.frontend
    docs = {} if not frontend.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="fleet", version=fleet.__version__, lifespan=lifespan, root_path=frontend.root_path or "",
                  **docs)
    document_fleet_errors(app)
    served_names = config.model.served_model_name or [config.model.model]
    serving = Serving(engine, served_names[0], sandbox)
    responses = ResponsesServing(serving, store, engine.client_index, peers.get)
    metrics = engine.metrics
    app.add_middleware(Gatekeeper, api_keys=config.frontend.api_key, server_index=engine.client_index,
                       max_body_bytes=config.frontend.max_request_body_bytes,
                       metrics_require_key=config.frontend.metrics_require_key)

    @app.exception_handler(Exception)
    async def unexpected(_: Request, error: Exception):  # the Gatekeeper logs it
        return error_response(500, f"internal error: {type(error).__name__}: {error}")

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, InvalidParameter):  # raised by a model validator, which knows the field
            return error_response(400, str(cause), cause.param)
        location = [str(part) for part in first.get("loc", []) if part != "body"]
        param = ".".join(location) or None
        message = first.get("msg", "invalid request body")
        if first.get("type") == "json_invalid":
            message, param = "the request body is not valid JSON", None
        return error_response(400, f"{message}" + (f" ({param})" if param else ""), param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException):
        return error_response(error.status_code, str(error.detail))

    @app.exception_handler(APIError)
    async def api_error(_: Request, error: APIError):
        return error_response(error.status, str(error), error.param)

    @app.exception_handler(InvalidParameter)
    async def invalid_parameter(_: Request, error: InvalidParameter):
        return error_response(400, str(error), error.param)

    @app.exception_handler(PeerUnreachable)
    async def peer_unreachable(_: Request, error: PeerUnreachable):
        return error_response(503, str(error))

    @app.exception_handler(EngineDeadError)
    @app.exception_handler(ServerStopping)
    @app.exception_handler(RequestFailed)
    async def not_served(_: Request, error: Exception):
        return error_response(*_unserved(error))

    def check_model(name: str | None) -> None:
        if name is not None and name not in served_names:
            raise APIError(404, f"The model `{name}` does not exist. Served: {served_names}", "model")
        if engine.dead_reason is not None:
            raise EngineDeadError(engine.dead_reason)

    @app.get("/health")
    async def health(request: Request):
        """200 while a replica serves; `?verbose`: the state of each replica too."""
        if engine.dead_reason is not None:
            return error_response(503, engine.dead_reason)
        replicas = engine.replica_states()
        serving = any(replica["state"] == "up" for replica in replicas)
        status = 200 if serving else 503
        if "verbose" in request.query_params:
            return JSONResponse({"status": "serving" if serving else "no replica serves", "replicas": replicas},
                                status_code=status)
        if not serving:
            return error_response(503, "no replica serves: " + "; ".join(r["reason"] for r in replicas))
        return Response(status_code=200, media_type="text/plain")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping(request: Request):  # SageMaker's name for /health, as in vLLM
        return await health(request)

    @app.get("/load")
    async def load():
        return {"server_load": engine.num_unfinished()}

    @app.get("/version")
    async def version():
        return {"version": fleet.__version__}

    def model_card(name: str, created: int) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "fleet", "root": config.model.model,
                "max_model_len": config.model.max_model_len}

    @app.get("/v1/models")
    async def models():
        created = now()
        return {"object": "list", "data": [model_card(name, created) for name in served_names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in served_names:
            raise APIError(404, f"The model `{name}` does not exist. Served: {served_names}", "model")
        return model_card(name, now())

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        if serving.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if body.messages is not None:
            text = await off_loop(serving.chat_prompt, body.as_chat())
            tokens = await off_loop(serving.tokenizer.encode, text, add_special_tokens=False)
        elif body.prompt is not None:
            serving.check_prompt_chars(body.prompt, "prompt")
            tokens = await off_loop(serving.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "give `prompt` or `messages`", "prompt")
        return {"tokens": tokens, "count": len(tokens), "max_model_len": config.model.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        if serving.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        vocab = serving.vocab_size or 0
        outside = [token for token in body.tokens if not 0 <= token < vocab]
        if outside:
            raise InvalidParameter("tokens", f"tokens must be in [0, {vocab}), got {outside[0]}")
        return {"prompt": await off_loop(serving.tokenizer.decode, body.tokens)}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        prompts = body.prompts()
        if not prompts:
            raise InvalidParameter("prompt", "the prompt is empty")
        serving.check_input_count(len(prompts), "prompt")
        check_kv_transfer_params(body.kv_transfer_params, request.headers, config)
        prepared = await off_loop(serving.prepare_prompts, prompts, body, body.logprobs)
        if body.stream:
            return _stream(serving.completion_stream(body, prepared))
        return await _unless_disconnected(serving.completion(body, prepared), request)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        check_model(body.model)
        inputs = body.inputs()
        if not inputs:
            raise InvalidParameter("input", "the input is empty")
        serving.check_input_count(len(inputs), "input")
        try:
            prompts = await off_loop(lambda: [serving.embedding_prompt(prompt) for prompt in inputs])
        except InvalidParameter as error:
            raise InvalidParameter("input", str(error)) from None
        return await _unless_disconnected(serving.embeddings(body, prompts), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidParameter("top_logprobs", "top_logprobs needs logprobs: true")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        check_kv_transfer_params(body.kv_transfer_params, request.headers, config)
        prepared, tools = await off_loop(lambda: serving.prepare_chat(body, logprobs))
        if body.stream:
            return _stream(serving.chat_stream(body, prepared, tools))
        return await _unless_disconnected(serving.chat(body, prepared, tools), request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        check_model(body.model)
        turn = await responses.prepare(body, owner(request))
        if body.stream:
            return StreamingResponse(responses.stream(turn), media_type="text/event-stream")
        return await _unless_disconnected(responses.create(turn), request)

    def owner(request: Request) -> str | None:
        return owner_of(request.headers.get("authorization", ""), config.frontend.api_key)

    async def stored(response_id: str, request: Request, action: str = "get"):
        """The asking key's response: another key's is as unknown as an id never made (a 404 either way)."""
        entry = await peers.act(action, response_id, owner(request))
        if entry is None:
            raise APIError(404, f"Response with id '{response_id}' not found.", "response_id")
        return entry

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return (await stored(response_id, request)).response

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(response_id: str, request: Request):
        items = [{"id": item.get("id") or f"item_{index}", **item}
                 for index, item in enumerate((await stored(response_id, request)).input_items)]
        return {"object": "list", "data": items, "first_id": items[0]["id"] if items else None,
                "last_id": items[-1]["id"] if items else None, "has_more": False}

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        await stored(response_id, request, "delete")
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str, request: Request):
        entry = await stored(response_id, request)
        if not entry.response.get("background"):
            raise APIError(400, "Only background responses can be cancelled.", "response_id")
        return (await stored(response_id, request, "cancel")).response

    return app


async def off_loop(function, *args, **kwargs):
    """Tokenising or templating a large prompt takes seconds: a thread does it,
    so that the event loop keeps answering (/health, other requests' tokens)."""
    return await asyncio.to_thread(function, *args, **kwargs)


UNSERVED = (RequestFailed, EngineDeadError, ServerStopping)
"""Why an accepted request got no (complete) answer: a failure in the engine, a dead engine, the drain's end."""


def _unserved(error: Exception) -> tuple[int, str]:
    """The status and message of an UNSERVED error, for a response or a stream's last event."""
    if isinstance(error, RequestFailed):
        return 500, f"the request failed in the engine: {error}"
    return 503, str(error)


def _stream(events) -> StreamingResponse:
    """A stream that fails part-way ends with an error event and [DONE]: its
    200 status has already gone out."""

    async def guarded():
        try:
            async for event in events:
                yield event
        except UNSERVED as error:
            yield f"data: {msgspec.json.encode(error_body(*_unserved(error))).decode()}\n\n"
            yield "data: [DONE]\n\n"

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def _unless_disconnected(work, request: Request):
    """Run a non-streaming request; if the client goes away, cancel it (which
    aborts it in the engine) instead of computing an answer nobody reads.

    The route has read the whole body, so the next message on the ASGI receive
    channel is the client's disconnect: waiting on it stops the request the
    moment the client leaves, not at the next poll."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_client_disconnect(request))
    try:
        await asyncio.wait({task, disconnect}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        disconnect.cancel()
    if not task.done():
        task.cancel()
        return Response(status_code=HTTPStatus.NO_CONTENT)
    return task.result()


async def _client_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


# ---- the API server process ------------------------------------------------------------


def run_api_server(name: str, info: APIServerStartupInfo) -> None:
    import uvicorn

    from fleet.workers.tokenizer import load_tokenizer

    config, plan = info.config, info.plan

    def build() -> tuple[AsyncEngine, Sandbox, FastAPI]:
        metrics = Metrics(config.model.served_model_name[0] if config.model.served_model_name else config.model.model)
        tokenizer = load_tokenizer(config.model)
        sandbox = Sandbox(plan.index, startup_info(config, tokenizer), config.frontend.sandbox_processes,
                          config.frontend.sandbox_timeout)
        engine = AsyncEngine(config, tokenizer, plan.index, plan.addresses, metrics, plan.load_address)
        engine.connect(plan.num_engines)
        return engine, sandbox, build_app(engine, config, sandbox, plan.response_store_addresses)

    engine, sandbox, app = processes.start_or_report(name, info.handshake_address, build)
    drain = config.frontend.shutdown_timeout
    frontend = config.frontend
    server = uvicorn.Server(uvicorn.Config(
        app, log_level=frontend.uvicorn_log_level, timeout_graceful_shutdown=drain,
        http=guarded_protocol(frontend.http_header_timeout, frontend.max_connections),
        timeout_keep_alive=frontend.http_keep_alive_timeout, ws="none"))  # no route is a WebSocket
    listener = inherited_listener(info.listen_fd)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[listener]))
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            processes.report(info.handshake_address, Ready(name, os.getpid()))
        cutter = asyncio.create_task(_stop_unfinished_at_drain_end(server, engine, drain))
        await task
        cutter.cancel()

    asyncio.run(serve())
    sandbox.close()
    engine.shutdown()


async def _stop_unfinished_at_drain_end(server, engine: AsyncEngine, drain: float) -> None:
    """After SIGTERM uvicorn lets requests in flight run for `drain` seconds,
    then cuts their connections. End them a moment before, with an error that
    says why, so that a client knows its answer is incomplete."""
    while not server.should_exit:
        await asyncio.sleep(0.1)
    _exit_after(drain + EXIT_MARGIN_S)
    await asyncio.sleep(max(0.0, drain - DRAIN_CUT_MARGIN_S))
    engine.stop_unfinished(f"the server shut down before the request finished (--shutdown-timeout {drain:g} s)")


def _exit_after(seconds: float) -> None:
    """End the process `seconds` from now if it has not ended by then: asyncio
    waits for its worker threads at exit, and a thread busy with a request
    (tokenising a long text) must not hold a stopping server past its timeout."""

    def exit_now() -> None:
        logger.warning("still running %g s after the stop began: exiting now", seconds)
        logging.shutdown()
        os._exit(1)

    timer = threading.Timer(seconds, exit_now)
    timer.daemon = True
    timer.start()


def inherited_listener(fd: int) -> socket.socket:
    """The launcher's listening socket, as a socket object that knows it is
    TCP (read from the descriptor). uvicorn.Config(fd=...) wraps a descriptor
    as AF_UNIX, so asyncio left Nagle's algorithm on for every connection and
    each response after the first on a kept-alive connection waited ~40 ms
    for the client's delayed ACK."""
    return socket.socket(fileno=fd)


def main() -> None:
    processes.child_main(APIServerStartupInfo, run_api_server)


if __name__ == "__main__":
    main()
