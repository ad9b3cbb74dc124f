"""What the data-parallel tests share: concurrent greedy requests checked
against transformers, and metrics gathered from every API server."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from tests.engine.conftest import random_prompts
from tests.engine.oracle import greedy, hf_model
from tests.frontend.server import Server

MAX_TOKENS = 6


def expected_texts(server: Server, model_dir: str, prompts: list[list[int]]) -> list[str]:
    """The oracle's tokens as the server's text. Text round trips are not
    always token-exact, so texts are compared; a streamed text holds back an
    incomplete UTF-8 character at its end, which /detokenize shows as U+FFFD."""
    oracle = hf_model(model_dir)
    tokens = [greedy(oracle, prompt, MAX_TOKENS) for prompt in prompts]
    texts = [server.post("/detokenize", json={"tokens": t}).json()["prompt"] for t in tokens]
    return [text.rstrip("\ufffd") for text in texts]


def complete_concurrently(server: Server, prompts: list[list[int]], base_url: str | None = None) -> list[dict]:
    """POST every prompt at once (greedy, exactly MAX_TOKENS tokens); the
    JSON bodies, with the answering API server's index under "api_server"."""

    def one(prompt: list[int]) -> dict:
        body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "min_tokens": MAX_TOKENS, "temperature": 0,
                "skip_special_tokens": False}  # as /detokenize does
        response = server.post("/v1/completions", json=body) if base_url is None else _post(base_url, body)
        assert response.status_code == 200, response.text
        return {**response.json(), "api_server": response.headers["fleet-api-server"]}

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def _post(base_url: str, body: dict):
    import httpx

    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def assert_greedy_over_http(server: Server, model_dir: str, count: int, seed: int,
                            base_url: str | None = None) -> list[dict]:
    prompts = random_prompts(count, 512, seed=seed, max_len=40)
    bodies = complete_concurrently(server, prompts, base_url)
    assert [b["choices"][0]["text"] for b in bodies] == expected_texts(server, model_dir, prompts)
    return bodies


def metrics_of_every_api_server(server: Server, count: int, attempts: int = 200) -> dict[str, str]:
    """/metrics of each of `count` API servers sharing the port (the kernel
    hands each new connection to one of them)."""
    pages: dict[str, str] = {}
    for _ in range(attempts):
        response = server.get("/metrics")
        pages[response.headers["fleet-api-server"]] = response.text
        if len(pages) == count:
            return pages
    raise AssertionError(f"only API servers {sorted(pages)} answered /metrics")


def per_engine(pages: dict[str, str], metric: str) -> dict[str, float]:
    """A metric summed over API servers and label sets, by its engine label."""
    totals: dict[str, float] = {}
    for text in pages.values():
        for line in text.splitlines():
            match = re.match(rf'{re.escape(metric)}{{(.*)}} (\S+)$', line)
            if match:
                engine = re.search(r'engine="(\d+)"', match.group(1)).group(1)
                totals[engine] = totals.get(engine, 0.0) + float(match.group(2))
    return totals
