"""SamplingParams.validate: every value a worker would trip over is refused
with InvalidParameter naming the field, before the request reaches an engine."""
from __future__ import annotations

import math

import pytest

from fleet.core.sampling_params import MAX_N, MAX_STOP, MAX_STOP_CHARS, InvalidParameter, SamplingParams

VOCAB = 512


@pytest.mark.parametrize(
    "fields,param",
    [
        (dict(logit_bias={VOCAB: 5.0}), "logit_bias"),
        (dict(logit_bias={100_000: 5.0}), "logit_bias"),
        (dict(logit_bias={-1: 100.0}), "logit_bias"),
        (dict(logit_bias={-100_000: 1.0}), "logit_bias"),
        (dict(logit_bias={3: math.nan}), "logit_bias"),
        (dict(logit_bias={3: math.inf}), "logit_bias"),
        (dict(logit_bias={3: 1e308}), "logit_bias"),
        (dict(logit_bias={3: 100.5}), "logit_bias"),
        (dict(stop_token_ids=[1_000_000_000], min_tokens=2), "stop_token_ids"),
        (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
        (dict(stop_token_ids=[2**70]), "stop_token_ids"),
        (dict(seed=2**64), "seed"),
        (dict(top_k=2**70), "top_k"),
        (dict(max_tokens=2**70), "max_tokens"),
        (dict(temperature=math.nan), "temperature"),
        (dict(n=MAX_N + 1), "n"),
        (dict(n=0), "n"),
        (dict(stop=["s"] * (MAX_STOP + 1)), "stop"),
        (dict(stop=["s" * (MAX_STOP_CHARS + 1)]), "stop"),
        (dict(stop_token_ids=[3] * (MAX_STOP + 1)), "stop_token_ids"),
    ],
)
def test_refused_with_the_field_named(fields, param):
    with pytest.raises(InvalidParameter) as raised:
        SamplingParams(**fields).validate(vocab_size=VOCAB)
    assert raised.value.param == param


@pytest.mark.parametrize(
    "fields",
    [
        dict(logit_bias={0: -100.0, VOCAB - 1: 100.0}),
        dict(stop_token_ids=[0, VOCAB - 1], min_tokens=2),
        dict(seed=2**63 - 1, top_k=VOCAB * 4),
        dict(n=MAX_N),
        dict(stop=["s" * MAX_STOP_CHARS] * MAX_STOP, stop_token_ids=[3] * MAX_STOP),
    ],
)
def test_values_at_the_bounds_pass(fields):
    SamplingParams(**fields).validate(vocab_size=VOCAB)


def test_without_a_vocabulary_only_negative_ids_are_refused():
    SamplingParams(logit_bias={10**9: 1.0}, stop_token_ids=[10**9]).validate()
    with pytest.raises(InvalidParameter, match="logit_bias keys"):
        SamplingParams(logit_bias={-1: 1.0}).validate()
