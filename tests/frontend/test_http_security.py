"""What a client gets from a real launch with --api-key and --root-path before
any route runs: every route but /health and /ping (and /metrics, which
--metrics-require-key closes here) needs the key, with or without the prefix
and however the path is spelled; a request head that does not arrive within
--http-header-timeout, and an idle kept-alive connection, are closed; past
--max-connections a 503; a chunked body over the limit a 413; token ids that
are booleans or floats, and unknown chat roles, 400s; /openapi.json says 400
where FastAPI would say 422."""
from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import psutil
import pytest

from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
ROOT = "/api"
HEADER_TIMEOUT_S = 3.0
KEEP_ALIVE_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 4
BODY_LIMIT = 64 * 1024
SLACK_S = 3.0
"""How much later than its timeout a connection may be seen closed on a busy machine."""
DOCS_ROUTES = ["/docs", "/docs/oauth2-redirect", "/redoc"]
"""FastAPI's own routes, which /openapi.json does not list."""


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(str(tiny_llama_dir), "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M",
                    "--api-key", KEY, "--root-path", ROOT, "--metrics-require-key",
                    "--http-header-timeout", str(HEADER_TIMEOUT_S), "--http-keep-alive-timeout",
                    str(KEEP_ALIVE_TIMEOUT_S), "--max-connections", str(MAX_CONNECTIONS),
                    "--max-request-body-bytes", str(BODY_LIMIT))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def openapi(server) -> dict:
    response = server.get(ROOT + "/openapi.json", headers=AUTH)
    assert response.status_code == 200, response.text
    return response.json()


def address(server: Server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def request(server: Server, method: str, path: str, headers: dict | None = None) -> httpx.Response:
    body = {"json": {}} if method in ("POST", "PUT", "PATCH") else {}  # invalid: a 400 once past the key
    return httpx.request(method, server.url + path, headers=headers, timeout=30, **body)


def assert_unauthorized(response: httpx.Response) -> None:
    assert response.status_code == 401, (response.request.url, response.text)
    assert response.json()["error"] == {"message": response.json()["error"]["message"], "type": "AuthenticationError",
                                        "param": None, "code": 401}
    assert response.headers["www-authenticate"] == "Bearer"


def guarded_routes(openapi: dict) -> list[tuple[str, str]]:
    """(method, path) of every route of the app but the open ones, path parameters filled in."""
    routes = [(method.upper(), re.sub(r"\{[^}]*\}", "x", path))
              for path, operations in openapi["paths"].items() for method in operations]
    routes += [("GET", path) for path in [*DOCS_ROUTES, "/openapi.json", "/no/such/route"]]
    return [(method, path) for method, path in routes if path not in ("/health", "/ping")]


def test_every_route_but_health_and_ping_needs_the_key_with_or_without_the_prefix(server, openapi):
    routes = guarded_routes(openapi)
    assert {"/v1/chat/completions", "/tokenize", "/detokenize", "/load", "/version", "/metrics", "/docs"} <= {
        path for _, path in routes}
    for method, path in routes:
        for prefix in ("", ROOT):
            assert_unauthorized(request(server, method, prefix + path))
            assert_unauthorized(request(server, method, prefix + path, {"Authorization": "Bearer sk-test-012345678"}))
            assert_unauthorized(request(server, method, prefix + path, {"Authorization": f"Basic {KEY}"}))
            keyed = request(server, method, prefix + path, AUTH)
            assert keyed.status_code != 401, (method, prefix + path, keyed.text)
    for spelling in ("//v1/models", "/v1//models", "/v1/models/", "/V1/models", "/api//v1/models", "/API/v1/models",
                     "/v1/models/../../health", "/api/health/../v1/models", "/%761/models", "/api/%68ealth/../load"):
        status, body = raw_get(server, spelling)  # as sent: httpx would resolve the dot segments
        assert status == 401 and b"AuthenticationError" in body, (spelling, status, body)


def test_health_and_ping_are_open_and_send_a_content_type(server):
    for prefix in ("", ROOT):
        for method, path in (("GET", "/health"), ("GET", "/ping"), ("POST", "/ping")):
            response = httpx.request(method, server.url + prefix + path, timeout=30)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"].startswith("text/plain")
        for spelling in ("/health/", "//health", "/HEALTH", "/Ping/"):  # a redirect or a 404, never asked for the key
            assert raw_get(server, prefix + spelling)[0] != 401, spelling


def test_metrics_needs_the_key_with_metrics_require_key(server):
    assert_unauthorized(server.get("/metrics"))
    assert server.get(ROOT + "/metrics", headers=AUTH).status_code == 200


def test_the_openapi_document_lists_fleets_400_not_fastapis_422(server, openapi):
    assert_unauthorized(server.get("/openapi.json"))
    operations = [operation for path in openapi["paths"].values() for operation in path.values()]
    assert not [operation for operation in operations if "422" in operation["responses"]]
    bad_request = openapi["paths"]["/v1/chat/completions"]["post"]["responses"]["400"]
    assert bad_request["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    schemas = openapi["components"]["schemas"]
    assert set(schemas["ErrorInfo"]["properties"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schemas
    invalid = server.post(ROOT + "/v1/chat/completions", json={"messages": "hi"}, headers=AUTH)
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "messages"


def model(server: Server) -> str:
    return server.get("/v1/models", headers=AUTH).json()["data"][0]["id"]


def assert_bad_request(response: httpx.Response, param: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "BadRequestError", error
    return error


@pytest.mark.parametrize("prompt", [[True, 2], [1.0, 2], [[1, 2], [3, 2.0]], [[False]], [1, "a"]])
def test_booleans_and_floats_are_not_token_ids(server, prompt):
    body = {"model": model(server), "max_tokens": 1}
    error = assert_bad_request(server.post("/v1/completions", json={**body, "prompt": prompt}, headers=AUTH), "prompt")
    assert "token ids" in error["message"]
    assert_bad_request(server.post("/v1/embeddings", json={"model": body["model"], "input": prompt}, headers=AUTH),
                       "input")


def test_token_ids_elsewhere_are_strict_integers(server):
    name = model(server)
    assert_bad_request(server.post("/detokenize", json={"tokens": [1, True]}, headers=AUTH), "tokens.1")
    assert_bad_request(server.post("/detokenize", json={"tokens": [1.0]}, headers=AUTH), "tokens.0")
    body = {"model": name, "prompt": "hi", "max_tokens": 1}
    assert_bad_request(server.post("/v1/completions", json={**body, "stop_token_ids": [True]}, headers=AUTH),
                       "stop_token_ids.0")
    for key in ("1_0", " 1", "\u0661"):  # all of them int()'s 10, 1 and 1
        assert_bad_request(server.post("/v1/completions", json={**body, "logit_bias": {key: 1}}, headers=AUTH),
                           "logit_bias")
    for prompt in ([1, 2], [[1, 2], [3]]):
        ok = server.post("/v1/completions", json={**body, "prompt": prompt, "logit_bias": {"5": 1}}, headers=AUTH)
        assert ok.status_code == 200, ok.text


def test_an_unknown_chat_role_is_a_400(server):
    messages = [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]
    body = {"model": model(server), "messages": messages, "max_tokens": 1}
    error = assert_bad_request(server.post("/v1/chat/completions", json=body, headers=AUTH), "messages.1.role")
    assert "'assistant'" in error["message"]
    assert_bad_request(server.post("/tokenize", json={"messages": messages}, headers=AUTH), "messages.1.role")
    developer = {**body, "messages": [{"role": "developer", "content": "be brief"}, messages[0]]}
    assert server.post("/v1/chat/completions", json=developer, headers=AUTH).status_code == 200


def chunks(total: int, size: int = 16 * 1024):
    for start in range(0, total, size):
        yield b"a" * min(size, total - start)


def test_a_chunked_body_over_the_limit_is_a_413_like_a_sized_one(server):
    for content in (b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}', chunks(4 * BODY_LIMIT)):
        response = server.post(ROOT + "/v1/completions", content=content, headers=AUTH)
        assert response.status_code == 413, response.text
        assert "--max-request-body-bytes" in response.json()["error"]["message"]
        assert response.json()["error"]["type"] == "RequestTooLargeError"
    body = [b'{"model": "', model(server).encode(), b'", "prompt": "hi", "max_tokens": 1}']
    small = server.post(ROOT + "/v1/completions", content=iter(body), headers={**AUTH, "content-type": "application/json"})
    assert small.status_code == 200, small.text


def closed_at(sock: socket.socket, deadline: float) -> float:
    """When (time.monotonic) the server closes `sock`, by `deadline` (whatever it sends first is read and dropped)."""
    try:
        while True:
            sock.settimeout(max(0.0, deadline - time.monotonic()))
            if not sock.recv(65536):
                break
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail("the connection is still open at its deadline")
    return time.monotonic()


def connect(server: Server) -> socket.socket:
    return socket.create_connection(address(server), timeout=10)


def raw_get(server: Server, path: str) -> tuple[int, bytes]:
    """GET `path` exactly as spelled, without the key: the status and the body."""
    with connect(server) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: fleet\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    headers, _, body = data.partition(b"\r\n\r\n")
    return int(headers.split()[1]), body


def head(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: fleet\r\nAuthorization: Bearer {KEY}\r\n{extra}\r\n".encode()


def read_response(sock: socket.socket) -> bytes:
    """One response whose body has a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    headers, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: (\d+)", headers, re.IGNORECASE).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return headers


def test_a_request_head_slower_than_the_header_timeout_is_closed(server):
    """A connection that sends nothing, one whose head trickles in, and a kept-alive one whose second head does."""
    start = time.monotonic()
    silent, trickling, kept_alive = connect(server), connect(server), connect(server)
    kept_alive.sendall(head(ROOT + "/health"))
    assert read_response(kept_alive).startswith(b"HTTP/1.1 200")
    stop = threading.Event()

    def trickle() -> None:  # slowloris: a header line every 0.5 s, the head never ends
        try:
            trickling.sendall(b"GET /api/health HTTP/1.1\r\nHost: fleet\r\n")
            kept_alive.sendall(b"GET /api/health HTTP/1.1\r\n")
            while not stop.wait(0.5):
                trickling.sendall(b"X-Slow: 1\r\n")
                kept_alive.sendall(b"X-Slow: 1\r\n")
        except OSError:  # closed by the server
            pass

    threading.Thread(target=trickle, daemon=True).start()
    try:
        waits = [closed_at(sock, start + HEADER_TIMEOUT_S + SLACK_S) - start for sock in (silent, trickling, kept_alive)]
    finally:
        stop.set()
        for sock in (silent, trickling, kept_alive):
            sock.close()
    assert all(wait > HEADER_TIMEOUT_S - 0.5 for wait in waits), f"closed before the timeout: {waits}"
    fresh = connect(server)
    fresh.sendall(head(ROOT + "/health"))
    assert read_response(fresh).startswith(b"HTTP/1.1 200"), "a prompt client is served"
    fresh.close()


def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_timeout(server):
    sock = connect(server)
    sock.sendall(head(ROOT + "/v1/models"))
    headers = read_response(sock)
    assert headers.startswith(b"HTTP/1.1 200") and b"connection: close" not in headers.lower()
    answered = time.monotonic()
    wait = closed_at(sock, answered + KEEP_ALIVE_TIMEOUT_S + SLACK_S) - answered
    sock.close()
    assert KEEP_ALIVE_TIMEOUT_S - 0.5 < wait < HEADER_TIMEOUT_S, wait


def open_connections(server: Server) -> int:
    """TCP connections the API server holds on its HTTP port."""
    (api_server,) = server.children_named("fleet-api-0")
    port = address(server)[1]
    return sum(1 for c in api_server.net_connections("tcp")
               if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)


def test_past_max_connections_a_503_and_none_outlives_the_header_timeout(server):
    assert server.wait_until(lambda: open_connections(server) == 0, timeout=HEADER_TIMEOUT_S + SLACK_S)
    held = [connect(server) for _ in range(MAX_CONNECTIONS)]
    crowd = []
    try:
        assert server.wait_until(lambda: open_connections(server) == MAX_CONNECTIONS, timeout=2)
        refused = server.get(ROOT + "/v1/models", headers=AUTH)
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        assert "--max-connections" in refused.json()["error"]["message"]
        assert refused.headers["connection"] == "close"
        crowd = [connect(server) for _ in range(3 * MAX_CONNECTIONS)]
        assert server.wait_until(lambda: open_connections(server) == 0, timeout=HEADER_TIMEOUT_S + SLACK_S), \
            "idle connections, inside the cap or past it, outlived the header timeout"
    finally:
        for sock in held + crowd:
            sock.close()
    assert server.get(ROOT + "/v1/models", headers=AUTH).status_code == 200


def test_bytes_that_are_not_http_get_an_openai_400(server):
    sock = connect(server)
    sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    sock.close()
    headers, _, body = data.partition(b"\r\n\r\n")
    assert headers.startswith(b"HTTP/1.1 400") and b"application/json" in headers
    assert httpx.Response(400, content=body).json()["error"]["type"] == "BadRequestError"
