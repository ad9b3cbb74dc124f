"""Stored responses belong to the API key that made them, over HTTP against
a real launch of two API servers with two keys: the other key's GET,
input_items, DELETE, cancel and previous_response_id find nothing (the
answer of an id never made, from either API server), and its flood of stored
responses evicts none of the first key's, nor cancels its running one."""
from __future__ import annotations

import httpx
import openai
import pytest

from fleet.tests.frontend.server import Server
from fleet.tests.frontend.test_responses import LONG_JSON, wait_for_status

pytestmark = pytest.mark.slow

MAX_STORED = 3
REQUEST_TOKENS = 1024


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--api-key", "key-a", "key-b", "--api-server-count", "2",
                    "--max-stored-responses", str(MAX_STORED), "--max-request-tokens", str(REQUEST_TOKENS))
    yield server
    assert server.stop() == 0


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0)


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def model(server) -> str:
    return server.get("/v1/models", headers=auth("key-a")).json()["data"][0]["id"]


def test_another_key_finds_nothing(server, model):
    a, b = client(server, "key-a"), client(server, "key-b")
    created = a.responses.create(model=model, input="Hi", max_output_tokens=4, temperature=0)
    unknown = created.id.replace(created.id[5:13], "00000000")  # an id of the same server that was never made
    answered_by = set()
    for _ in range(60):  # each request on a new connection: either API server may take it
        for path in (f"/v1/responses/{created.id}", f"/v1/responses/{created.id}/input_items"):
            theirs = server.get(path, headers=auth("key-b"))
            never_made = server.get(path.replace(created.id, unknown), headers=auth("key-b"))
            assert theirs.status_code == 404, theirs.text
            assert theirs.json() == _with_id(never_made.json(), unknown, created.id), "the answers differ"
            answered_by.add(theirs.headers["fleet-api-server"])
        if len(answered_by) == 2:
            break
    assert answered_by == {"0", "1"}, "one API server answered for the other's response"
    for call in (b.responses.delete, b.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call(created.id)
    continued = server.post("/v1/responses", headers=auth("key-b"),
                            json={"model": model, "input": "And?", "previous_response_id": created.id})
    never = server.post("/v1/responses", headers=auth("key-b"),
                        json={"model": model, "input": "And?", "previous_response_id": unknown})
    assert continued.status_code == never.status_code == 400, continued.text
    assert continued.json() == _with_id(never.json(), unknown, created.id)
    assert continued.json()["error"]["param"] == "previous_response_id"
    assert a.responses.retrieve(created.id).output_text == created.output_text, "key-b's DELETE deleted it"
    follow_up = a.responses.create(model=model, previous_response_id=created.id, input="And?", max_output_tokens=2)
    assert follow_up.status in ("completed", "incomplete")


def _with_id(body: dict, old: str, new: str) -> dict:
    error = body["error"]
    return {"error": {**error, "message": error["message"].replace(old, new)}}


def test_another_keys_flood_evicts_nothing(server, model):
    """On one connection (one API server): key-a's stored and running responses outlive key-b's flood."""
    a = client(server, "key-a")
    with httpx.Client(base_url=server.base_url, timeout=60) as one_server:
        def create(key: str, **fields) -> dict:
            reply = one_server.post("/responses", headers=auth(key), json={"model": model, "input": "Hi", **fields})
            assert reply.status_code == 200, reply.text
            return reply.json()

        kept = create("key-a", max_output_tokens=2)["id"]
        running = create("key-a", max_output_tokens=900, background=True,
                         text={"format": {"type": "json_schema", "name": "long", "schema": LONG_JSON}})["id"]
        wait_for_status(a, running, {"in_progress"})
        flood = [create("key-b", max_output_tokens=2)["id"] for _ in range(MAX_STORED + 2)]
        statuses = [one_server.get(f"/responses/{i}", headers=auth("key-b")).status_code for i in flood]
        assert statuses == [404] * 2 + [200] * MAX_STORED, "key-b's own oldest go"
        assert one_server.get(f"/responses/{kept}", headers=auth("key-a")).status_code == 200
        status = one_server.get(f"/responses/{running}", headers=auth("key-a")).json()["status"]
        assert status in ("in_progress", "completed", "incomplete"), status
        assert a.responses.cancel(running).status in ("cancelled", "completed", "incomplete")
    assert server.wait_until(lambda: server.metric("fleet:num_requests_running") == 0, timeout=10)


def test_a_response_counts_toward_max_request_tokens(server, model):
    reply = server.post("/v1/responses", headers=auth("key-a"),
                        json={"model": model, "input": "Hi", "max_output_tokens": REQUEST_TOKENS})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "max_tokens" and "--max-request-tokens" in error["message"], error
