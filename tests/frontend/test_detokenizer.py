"""Incremental detokenisation with the real SmolLM2 tokenizer: multi-byte
UTF-8 and stop strings that span token boundaries."""
from __future__ import annotations

import pytest

from fleet import SamplingParams
from fleet.config import EngineArgs
from fleet.frontend.detokenizer import IncrementalDetokenizer
from fleet.workers.tokenizer import load_tokenizer

TEXT = "Café ☕ naïve 日本語 — 😀🚀 done"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(EngineArgs(device="cpu").create_config().model)


def test_token_by_token_equals_full_decode(tokenizer):
    prompt = tokenizer.encode("Say:")
    tokens = tokenizer.encode(TEXT)
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    seen = []
    for token in tokens:
        detokenizer.append([token])
        seen.append(detokenizer.text)
        assert "\ufffd" not in detokenizer.text  # half a character is never shown
    assert detokenizer.text == tokenizer.decode(tokens)
    assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))  # text only grows


def test_stop_string_across_tokens_is_cut(tokenizer):
    tokens = tokenizer.encode(TEXT)
    stop = "日本"
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=[stop]))
    found = None
    for token in tokens:
        found = detokenizer.append([token])
        if found:
            break
    assert found == stop
    assert detokenizer.text == TEXT[: TEXT.index(stop)]


def test_streams_hold_back_a_possible_stop_prefix(tokenizer):
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xyz"]))
    detokenizer.append(tokenizer.encode("abc x"))
    assert detokenizer.stable_text_length(finished=False) == len(detokenizer.text) - 2
    assert detokenizer.stable_text_length(finished=True) == len(detokenizer.text)
