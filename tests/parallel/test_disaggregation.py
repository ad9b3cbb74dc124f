"""Prefill/decode disaggregation as a user runs it: a prefill instance and a
decode instance (separate `fleet launch`es, tensor parallel on both sides)
behind `fleet proxy`; greedy outputs against transformers; the decode
instance's metrics show that it pulled the prompts' KV instead of computing
them; a transfer that fails and a prefill instance that dies cost no request.
And as a hostile client would try it: kv_transfer_params without the secret,
another prompt's KV, producers that answer garbage or nothing, malformed
messages to the export and release sockets."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq

from fleet.frontend.kv_transfer_gate import SECRET_HEADER
from fleet.tests.engine.helpers import random_prompts
from fleet.tests.engine.oracle import greedy, hf_model
from fleet.tests.frontend.server import Server

pytestmark = pytest.mark.slow

TINY = ("--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M", "--tensor-parallel-size", "2")
MAX_TOKENS = 6
SECRET = "a-secret-of-the-operator"
TRUSTED = {SECRET_HEADER: SECRET}
"""What `fleet proxy --kv-transfer-secret` adds: the tests that play the proxy send it."""
TRANSFER_TIMEOUT_S = 5


def kv_config(role: str, **extra) -> str:
    return json.dumps({"kv_role": role, "kv_connector": "FleetConnector",
                       "kv_connector_extra_config": {"secret": SECRET, **extra}})


@pytest.fixture(scope="module")
def instances(tiny_llama_dir):
    prefill = Server(tiny_llama_dir, *TINY, "--kv-transfer-config", kv_config("kv_producer"))
    decode = Server(tiny_llama_dir, *TINY, "--kv-transfer-config",
                    kv_config("kv_consumer", transfer_timeout_s=TRANSFER_TIMEOUT_S))
    proxy = Server("--prefill", prefill.url, "--decode", decode.url, "--kv-transfer-secret", SECRET, command="proxy")
    yield prefill, decode, proxy
    for server in (proxy, decode, prefill):
        server.close()


def complete(base_url: str, prompt: list[int], stream: bool = False, headers: dict | None = None, **extra) -> str:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0,
            "skip_special_tokens": False, "stream": stream, **extra}
    if not stream:
        response = httpx.post(base_url + "/v1/completions", json=body, headers=headers, timeout=120)
        assert response.status_code == 200, response.text
        assert "kv_transfer_params" not in response.json() or extra.get("kv_transfer_params", {}).get(
            "do_remote_decode")
        return response.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", base_url + "/v1/completions", json=body, headers=headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def expected(server: Server, model_dir: str, prompts: list[list[int]]) -> list[str]:
    oracle = hf_model(model_dir)
    tokens = [greedy(oracle, prompt, MAX_TOKENS) for prompt in prompts]
    # Random token ids may split a UTF-8 character at either end of the output: the server's text and
    # /detokenize's show such a byte differently (the stream holds it back, /detokenize as U+FFFD).
    return [server.post("/detokenize", json={"tokens": t}).json()["prompt"].strip("\ufffd") for t in tokens]


def held_for_decode(prefill: Server, prompt: list[int]) -> dict:
    """What the proxy does first: the prompt computed by the prefill instance, its KV held; the params."""
    answer = httpx.post(prefill.url + "/v1/completions", headers=TRUSTED, timeout=60, json={
        "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert answer.status_code == 200, answer.text
    return answer.json()["kv_transfer_params"]


def test_outputs_through_the_proxy_match_transformers_and_the_decode_instance_computes_no_prompt(
        instances, tiny_llama_dir):
    prefill, decode, proxy = instances
    prompts = random_prompts(8, 512, seed=3, max_len=60)
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda i: complete(proxy.url, prompts[i], stream=i % 2 == 1), range(len(prompts))))
    assert [t.strip("\ufffd") for t in texts] == expected(decode, tiny_llama_dir, prompts)
    assert proxy.get("/proxy/stats").json() == {"prefilled": len(prompts), "fallbacks": 0}
    # Each prompt's KV but its last token came from the prefill instance; none was computed on the decode one.
    transferred = sum(len(p) - 1 for p in prompts)
    assert decode.wait_until(lambda: decode.metric("fleet:kv_transfer_tokens_total") == transferred)
    assert decode.metric("fleet:prefix_cache_hits_total") == 0
    assert decode.metric("fleet:kv_transfer_failures_total") == 0
    # The prefill instance freed every prompt's blocks once they were pulled (the usage it
    # reports with a later request's answer counts the blocks held for transfers).
    assert prefill.wait_until(lambda: _kv_usage_after_a_request(prefill) == 0.0)


def test_held_kv_is_named_by_128_random_bits(instances):
    prefill, _, _ = instances
    prompt = random_prompts(1, 512, seed=9, max_len=20)[0]
    held = [held_for_decode(prefill, prompt) for _ in range(2)]
    ids = [params["transfer_id"] for params in held]
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ids) and ids[0] != ids[1]
    _release(held)


def _release(held: list[dict]) -> None:
    """Tell the prefill instance that the KV was taken, as a decode instance does."""
    from fleet.core import serial
    from fleet.core.messages import KVRelease

    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(held[0]["remote_release_address"])
    for params in held:
        push.send(serial.encode(KVRelease(params["transfer_id"])))
    push.close(linger=5000)
    ctx.term()


def test_a_failed_transfer_computes_the_prompt_on_the_decode_instance(instances, tiny_llama_dir):
    prefill, decode, proxy = instances
    prompts = random_prompts(3, 512, seed=4, max_len=40)
    params = held_for_decode(prefill, prompts[0])
    unreachable = {**params, "remote_kv_addresses": ["tcp://127.0.0.1:9", "tcp://127.0.0.1:9"]}
    unknown = {**params, "transfer_id": "00" * 16, "remote_num_tokens": len(prompts[1])}
    nonsense = {**unknown, "remote_kv_addresses": ["not an address", "tcp://"], "remote_num_tokens": len(prompts[2])}
    failures = decode.metric("fleet:kv_transfer_failures_total")
    with ThreadPoolExecutor(3) as pool:
        texts = list(pool.map(lambda args: complete(decode.url, args[0], headers=TRUSTED, kv_transfer_params=args[1]),
                              [(prompts[0], unreachable), (prompts[1], unknown), (prompts[2], nonsense)]))
    assert [t.strip("\ufffd") for t in texts] == expected(decode, tiny_llama_dir, prompts)
    assert decode.wait_until(lambda: decode.metric("fleet:kv_transfer_failures_total") == failures + 3)


def test_kv_transfer_params_are_a_400_without_the_secret_or_where_an_instance_cannot_take_them(instances):
    prefill, decode, proxy = instances
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    refused = [
        (decode, {"do_remote_decode": True}, TRUSTED),  # a consumer holds no KV for others
        (prefill, {"do_remote_prefill": True}, TRUSTED),  # a producer pulls none
        (decode, {"do_remote_prefill": "yes"}, TRUSTED),
        (decode, ["not", "an", "object"], TRUSTED),
        (prefill, {"do_remote_decode": True}, None),  # a client's: no secret
        (prefill, {"do_remote_decode": True}, {SECRET_HEADER: SECRET[:-1]}),
        (decode, {"do_remote_prefill": True, "transfer_id": "00" * 16}, {SECRET_HEADER: ""}),
        (proxy, {"do_remote_decode": True}, TRUSTED),  # the proxy writes them; a client's copy of the header is dropped
    ]
    for server, params, headers in refused:
        for path, shaped in (("/v1/completions", body), ("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})):
            response = httpx.post(server.url + path, headers=headers, timeout=30,
                                  json={**shaped, "kv_transfer_params": params})
            assert response.status_code == 400, (server.url, params, headers, response.text)
            assert response.json()["error"]["param"] == "kv_transfer_params"
    assert prefill.wait_until(lambda: _kv_usage_after_a_request(prefill) == 0.0)  # nothing was held


def test_another_prompt_cannot_read_or_poison_with_a_held_transfer(instances, tiny_llama_dir):
    """A thief that knows the params of a victim's held KV asks for its own prompt (of the same length)
    with them: the producer refuses to serve another prompt, so the thief's answer is its own prompt's,
    computed on the decode instance, and nothing of the victim's lands in its prefix cache."""
    prefill, decode, _ = instances
    victim, thief = random_prompts(2, 512, seed=11, min_len=48, max_len=49)
    params = held_for_decode(prefill, victim)
    failures = decode.metric("fleet:kv_transfer_failures_total")
    assert complete(decode.url, thief, headers=TRUSTED, kv_transfer_params=params).strip("\ufffd") == \
        expected(decode, tiny_llama_dir, [thief])[0]
    assert decode.wait_until(lambda: decode.metric("fleet:kv_transfer_failures_total") == failures + 1)
    assert any("the transfer holds another prompt" in line for line in prefill.log)
    # Anyone's plain request for the thief's prompt, now a prefix-cache hit, is still right.
    assert complete(decode.url, thief).strip("\ufffd") == expected(decode, tiny_llama_dir, [thief])[0]
    # The failed pull released the victim's KV (a consumer that gives up always does).
    assert prefill.wait_until(lambda: _kv_usage_after_a_request(prefill) == 0.0)


class FakeProducer:
    """A listener of the test's own on 127.0.0.1 in place of a prefill worker: it answers each
    pull with `reply(frames)` (None: never)."""

    def __init__(self, reply):
        self.ctx = zmq.Context()
        self.socket = self.ctx.socket(zmq.ROUTER)
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.pulls = 0
        self.reply = reply
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:  # the socket is this thread's alone (zmq sockets are single-threaded)
        while not self.stopped.is_set():
            if not self.socket.poll(50):
                continue
            identity, *frames = self.socket.recv_multipart()
            self.pulls += 1
            answer = self.reply(frames)
            if answer is not None:
                self.socket.send_multipart([identity, *answer])
        self.socket.close(linger=0)

    def close(self) -> None:
        self.stopped.set()
        self.thread.join()
        self.ctx.term()


def test_a_silent_producer_stalls_no_other_request_and_costs_its_own_its_timeout(instances, tiny_llama_dir):
    _, decode, _ = instances
    silent = FakeProducer(lambda frames: None)
    prompts = random_prompts(2, 512, seed=12, max_len=30)
    params = {"do_remote_prefill": True, "transfer_id": "11" * 16, "remote_num_tokens": len(prompts[0]),
              "remote_kv_addresses": [silent.address, silent.address], "remote_release_address": silent.address}
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(complete, decode.url, prompts[0], headers=TRUSTED, kv_transfer_params=params)
        assert decode.wait_until(lambda: silent.pulls == 2)  # both workers wait for the silent producer
        # Meanwhile the replica steps on: a plain request is answered before the pull gives up.
        assert complete(decode.url, prompts[1]).strip("\ufffd") == expected(decode, tiny_llama_dir, prompts[1:])[0]
        assert not waiting.done()
        assert waiting.result().strip("\ufffd") == expected(decode, tiny_llama_dir, prompts[:1])[0]
    silent.close()


def test_garbage_from_a_producer_is_refused_and_the_prompt_computed_here(instances, tiny_llama_dir):
    _, decode, _ = instances
    from fleet.core import serial
    from fleet.core.messages import KVPull, KVPullReply

    def oversized(frames):  # 30 frames of 2 MiB: past the largest layer a request of the tiny model can hold
        pull = serial.Decoder(KVPull, "fake producer").decode(frames[0])
        return [serial.encode(KVPullReply(pull.pull_id, shape=[2, 1, 16, 4, 16], dtype="float32")),
                *[b"\0" * 2**21] * 30]

    def wrong_shape(frames):
        pull = serial.Decoder(KVPull, "fake producer").decode(frames[0])
        return [serial.encode(KVPullReply(pull.pull_id, shape=[2, pull.num_blocks, 16, 1, 1], dtype="float32")),
                b"\0" * 8]

    prompts = random_prompts(3, 512, seed=13, max_len=40)
    producers = [FakeProducer(oversized), FakeProducer(wrong_shape), FakeProducer(lambda frames: [b"junk"])]
    failures = decode.metric("fleet:kv_transfer_failures_total")
    texts = []
    for producer, prompt in zip(producers, prompts, strict=True):
        params = {"do_remote_prefill": True, "transfer_id": "22" * 16, "remote_num_tokens": len(prompt),
                  "remote_kv_addresses": [producer.address] * 2, "remote_release_address": producer.address}
        texts.append(complete(decode.url, prompt, headers=TRUSTED, kv_transfer_params=params))
        producer.close()
    assert [t.strip("\ufffd") for t in texts] == expected(decode, tiny_llama_dir, prompts)
    assert decode.wait_until(lambda: decode.metric("fleet:kv_transfer_failures_total") == failures + 3)
    decode.refresh_descendants()
    assert len(decode.children_named("fleet-worker")) == 2  # no worker died


def test_malformed_messages_to_a_producer_kill_no_thread(instances, tiny_llama_dir):
    prefill, decode, _ = instances
    prompt = random_prompts(1, 512, seed=14, max_len=40)[0]
    params = held_for_decode(prefill, prompt)
    ctx = zmq.Context()
    try:
        for address in [*params["remote_kv_addresses"], params["remote_release_address"]]:
            kind = zmq.PUSH if address == params["remote_release_address"] else zmq.DEALER
            socket = ctx.socket(kind)
            socket.connect(address)
            socket.send_multipart([b"two", b"frames"])
            socket.send(b"\x93not msgpack")
            socket.send(b"x" * 2**20)  # past the socket's maximum message size: zmq drops the connection
            socket.close(linger=1000)
    finally:
        ctx.term()
    tokens = decode.metric("fleet:kv_transfer_tokens_total")
    assert complete(decode.url, prompt, headers=TRUSTED, kv_transfer_params=params).strip("\ufffd") == \
        expected(decode, tiny_llama_dir, [prompt])[0]
    assert decode.wait_until(lambda: decode.metric("fleet:kv_transfer_tokens_total") == tokens + len(prompt) - 1)
    assert prefill.wait_until(lambda: _kv_usage_after_a_request(prefill) == 0.0)  # released, over the same socket


def test_a_dead_prefill_instance_costs_no_request(instances, tiny_llama_dir):
    prefill, decode, proxy = instances
    prefill.kill()
    prefill.assert_nothing_left()
    prompts = random_prompts(4, 512, seed=5, max_len=40)
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(proxy.url, p, stream=True), prompts))
    assert [t.strip("\ufffd") for t in texts] == expected(decode, tiny_llama_dir, prompts)
    assert proxy.get("/proxy/stats").json()["fallbacks"] == len(prompts)
    assert proxy.get("/health").status_code == 200


def _kv_usage_after_a_request(server: Server) -> float:
    assert server.post("/v1/completions", json={"prompt": [1], "max_tokens": 1}).status_code == 200
    return server.metric("fleet:kv_cache_usage_perc")


# ---- one launch: --disaggregate ------------------------------------------------------------------


@pytest.fixture(scope="module")
def disaggregated(tiny_llama_dir):
    server = Server(tiny_llama_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "2M",
                    "--disaggregate", "prefill=1,decode=1,min_prompt_tokens=8")
    yield server
    server.close()


def test_one_launch_prefills_on_one_replica_and_decodes_on_the_other(disaggregated, tiny_llama_dir):
    from fleet.tests.parallel.dp_helpers import per_engine

    server = disaggregated
    prompts = [p for p in random_prompts(8, 512, seed=6, max_len=60) if len(p) >= 8][:6]
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda i: complete(server.url, prompts[i], stream=i % 2 == 0), range(len(prompts))))
    assert [t.strip("\ufffd") for t in texts] == expected(server, tiny_llama_dir, prompts)
    transferred = sum(len(p) - 1 for p in prompts)
    server.wait_until(lambda: per_engine({"0": server.get("/metrics").text},
                                         "fleet:kv_transfer_tokens_total").get("1") == transferred)
    pages = {"0": server.get("/metrics").text}
    assert per_engine(pages, "fleet:kv_transfer_failures_total")["1"] == 0
    assert per_engine(pages, "fleet:kv_transfer_tokens_total")["1"] == transferred
    assert per_engine(pages, "fleet:generation_tokens_total")["1"] == len(prompts) * MAX_TOKENS
    assert per_engine(pages, "fleet:generation_tokens_total")["0"] == len(prompts)  # one dropped token each


def test_one_launch_takes_no_kv_transfer_params_from_a_client(disaggregated):
    for params in ({"do_remote_decode": True}, {"do_remote_prefill": True, "transfer_id": "00" * 16},
                   {"do_remote_prefill": False}):
        for headers in (None, {SECRET_HEADER: "anything"}):
            response = httpx.post(disaggregated.url + "/v1/completions", headers=headers, timeout=30, json={
                "prompt": list(range(10, 30)), "max_tokens": 2, "kv_transfer_params": params})
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == "kv_transfer_params"


def test_one_launch_computes_short_prompts_on_the_decode_replica(disaggregated, tiny_llama_dir):
    from fleet.tests.parallel.dp_helpers import per_engine

    server = disaggregated
    before = per_engine({"0": server.get("/metrics").text}, "fleet:generation_tokens_total")
    prompts = random_prompts(2, 512, seed=8, max_len=7)  # under min_prompt_tokens=8
    texts = [complete(server.url, prompt) for prompt in prompts]
    assert [t.strip("\ufffd") for t in texts] == expected(server, tiny_llama_dir, prompts)
    after = per_engine({"0": server.get("/metrics").text}, "fleet:generation_tokens_total")
    assert after["0"] == before["0"] and after["1"] == before["1"] + 2 * MAX_TOKENS


def test_one_launch_serves_on_while_its_prefill_replica_is_dead(disaggregated, tiny_llama_dir):
    server = disaggregated
    (engine,) = server.children_named("fleet-engine-dp0")
    engine.kill()
    prompts = [p for p in random_prompts(8, 512, seed=7, max_len=40) if len(p) >= 8][:4]
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: complete(server.url, p, stream=True), prompts))
    assert [t.strip("\ufffd") for t in texts] == expected(server, tiny_llama_dir, prompts)
    assert any("the decode replica computes a prompt itself" in line for line in server.log)
    assert server.wait_until(lambda: server.get("/health?verbose").json()["replicas"][0]["state"] == "up", 60)
    server.refresh_descendants()
