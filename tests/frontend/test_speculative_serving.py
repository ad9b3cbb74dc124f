"""`fleet launch --speculative-config` as a user starts it: two data-parallel replicas that each
verify ngram drafts, streamed and whole completions equal to transformers' greedy text, the
drafts counted in /metrics, and a config that cannot work refused by name before anything starts."""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from fleet.tests.engine.oracle import greedy, hf_model
from fleet.tests.frontend.server import CHECKOUT, Server

pytestmark = pytest.mark.slow

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2})


@pytest.fixture(scope="module")
def server(tiny_cycling_llama_dir):
    server = Server(tiny_cycling_llama_dir, "--dtype", "float32", "--device", "cpu", "--kv-cache-memory-bytes", "4M",
                    "--dp", "2", "--speculative-config", NGRAM)
    yield server
    assert server.stop() == 0
    server.assert_nothing_left()


def test_completions_with_drafts_are_transformers_greedy_text(server, tiny_cycling_llama_dir):
    model, tokenizer = hf_model(tiny_cycling_llama_dir), AutoTokenizer.from_pretrained(tiny_cycling_llama_dir)
    client = server.openai_client()
    name = client.models.list().data[0].id
    rng = random.Random(0)
    for index in range(4):
        prompt = [rng.randrange(3, 512) for _ in range(rng.randrange(5, 30))]
        body = dict(model=name, prompt=prompt, max_tokens=40, temperature=0, extra_body={"min_tokens": 40})
        if index % 2:
            text = "".join(chunk.choices[0].text for chunk in client.completions.create(stream=True, **body))
        else:
            text = client.completions.create(**body).choices[0].text
        assert text == tokenizer.decode(greedy(model, prompt, 40))
    accepted = server.metric("fleet:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < server.metric("fleet:spec_decode_num_draft_tokens_total")
    assert server.metric("fleet:spec_decode_num_drafts_total") > 0


@pytest.mark.parametrize("config, why", [
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not built"),
    ('{"method": "ngram"}', "num_speculative_tokens must be in [1, 16]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}', "unknown key(s) ['typo']"),
])
def test_a_config_that_cannot_work_is_refused_naming_the_flag(tiny_llama_dir, config, why):
    launch = subprocess.run([sys.executable, "-P", "-m", "fleet.frontend.cli", "launch", tiny_llama_dir,
                             "--device", "cpu", "--speculative-config", config],
                            capture_output=True, text=True, timeout=60, cwd=CHECKOUT)
    assert launch.returncode == 2, launch.stderr
    assert "--speculative-config" in launch.stderr and why in launch.stderr, launch.stderr
