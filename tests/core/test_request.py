from __future__ import annotations

import pytest

from fleet.core.request import FINISH_REASONS, Request, RequestStatus, hash_block_tokens
from fleet.tests.core.scheduler_factories import EOS_TOKEN_ID, create_requests


def make_request(max_model_len: int = 100, block_size: int | None = None, **kwargs) -> Request:
    (core_request,) = create_requests(1, kwargs.pop("num_tokens", 10), **kwargs)
    return Request(core_request, eos_token_ids=(EOS_TOKEN_ID,), max_model_len=max_model_len, block_size=block_size)


def test_status_order_and_finish_reasons():
    assert not RequestStatus.PREEMPTED.is_finished
    assert all(status > RequestStatus.PREEMPTED for status in FINISH_REASONS)
    assert set(FINISH_REASONS.values()) == {"stop", "length", "abort", "error"}
    request = make_request()
    assert request.finish_reason is None
    request.finish(RequestStatus.FINISHED_ERROR)
    assert request.is_finished and request.finish_reason == "error"


def test_counts():
    request = make_request(num_tokens=10)
    assert (request.num_prompt_tokens, request.num_tokens, request.num_output_tokens) == (10, 10, 0)
    assert request.append_output_token_ids([5, 6]) == [5, 6]
    assert request.num_tokens == 12 and request.output_token_ids == [5, 6]
    assert request.all_token_ids == request.prompt_token_ids + [5, 6]


def test_token_array_follows_the_tokens_as_they_grow():
    request = make_request(num_tokens=10, max_model_len=1000, max_tokens=500)
    assert request.all_token_array().tolist() == request.all_token_ids
    for step in range(40):  # past the buffer's first size, and growing again
        request.append_output_token_ids([100 + step, 200 + step][: 1 + step % 2])
        assert request.all_token_array().tolist() == request.all_token_ids
    assert request.all_token_array().dtype.name == "int64"


def test_eos_stops():
    request = make_request()
    request.append_output_token_ids(5)
    assert not request.is_finished
    request.append_output_token_ids(EOS_TOKEN_ID)
    assert request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason is None


def test_ignore_eos():
    request = make_request(ignore_eos=True, max_tokens=3)
    request.append_output_token_ids([EOS_TOKEN_ID, EOS_TOKEN_ID])
    assert not request.is_finished
    request.append_output_token_ids(EOS_TOKEN_ID)
    assert request.finish_reason == "length"


def test_stop_token_ids_set_stop_reason():
    request = make_request(stop_token_ids=[42])
    request.append_output_token_ids(42)
    assert request.finish_reason == "stop" and request.stop_reason == 42


def test_min_tokens_holds_back_eos_and_stop_ids():
    request = make_request(min_tokens=3, stop_token_ids=[42])
    request.append_output_token_ids([EOS_TOKEN_ID, 42])
    assert not request.is_finished
    request.append_output_token_ids(42)
    assert request.finish_reason == "stop" and request.num_output_tokens == 3


def test_max_tokens():
    request = make_request(max_tokens=2)
    request.append_output_token_ids(5)
    assert not request.is_finished
    request.append_output_token_ids(5)
    assert request.finish_reason == "length"


def test_stop_wins_over_length_on_the_same_token():
    request = make_request(max_tokens=1)
    request.append_output_token_ids(EOS_TOKEN_ID)
    assert request.finish_reason == "stop"


def test_max_model_len():
    request = make_request(num_tokens=10, max_model_len=12, max_tokens=None)
    assert request.max_tokens == 12
    request.append_output_token_ids(5)
    assert not request.is_finished
    request.append_output_token_ids(5)
    assert request.finish_reason == "length" and request.num_tokens == 12


def test_tokens_after_a_stop_are_dropped():
    request = make_request()
    assert request.append_output_token_ids([5, EOS_TOKEN_ID, 6, 7]) == [5, EOS_TOKEN_ID]
    assert request.output_token_ids == [5, EOS_TOKEN_ID]


def test_block_hashes_chain_over_prompt_and_outputs():
    request = make_request(num_tokens=10, block_size=4)
    assert len(request.block_hashes) == 2
    first = hash_block_tokens(b"", request.all_token_ids[:4])
    assert request.block_hashes[0] == first
    assert request.block_hashes[1] == hash_block_tokens(first, request.all_token_ids[4:8])
    request.append_output_token_ids([5])
    assert len(request.block_hashes) == 2
    request.append_output_token_ids([6])
    assert len(request.block_hashes) == 3
    assert request.block_hashes[2] == hash_block_tokens(request.block_hashes[1], request.all_token_ids[8:12])


def test_same_tokens_under_another_parent_hash_differently():
    assert hash_block_tokens(b"", [1, 2]) != hash_block_tokens(hash_block_tokens(b"", [0, 0]), [1, 2])


def test_preempt_resets_computed_but_keeps_first_cached_count():
    request = make_request(num_tokens=40)
    request.start_running(32)
    request.advance(8)
    request.append_output_token_ids(5)
    request.preempt()
    assert request.status == RequestStatus.PREEMPTED and request.num_computed_tokens == 0
    request.start_running(16)
    assert request.num_cached_tokens == 32 and request.num_computed_tokens == 16


def test_advance_past_the_tokens_is_a_bug():
    request = make_request(num_tokens=4)
    request.start_running(0)
    with pytest.raises(AssertionError):
        request.advance(5)
