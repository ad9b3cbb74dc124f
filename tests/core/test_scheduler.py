from __future__ import annotations

import pytest

from fleet.config.cache import CacheConfig
from fleet.config.scheduler import SchedulerConfig
from fleet.core.messages import ModelRunnerOutput
from fleet.core.request import RequestStatus
from fleet.core.scheduler import Scheduler
from fleet.tests.core.scheduler_factories import (
    EOS_TOKEN_ID,
    FakeWorker,
    add_requests,
    create_requests,
    create_scheduler,
    output_token_ids,
    run_to_completion,
    step,
)


def counting_sampler(scheduler: Scheduler):
    """Output k of every request is 1000 + k: a resumed request must continue the count."""
    return lambda request_id: 1000 + scheduler.requests[request_id].num_output_tokens


def empty_runner_output(scheduled) -> ModelRunnerOutput:
    return ModelRunnerOutput(step_id=scheduled.step_id, request_ids=[], sampled_token_ids=[])


# ---- batching ---------------------------------------------------------------------------


def test_all_requests_run_to_max_tokens():
    scheduler = create_scheduler()
    add_requests(scheduler, create_requests(4, 10, max_tokens=16))
    scheduled = scheduler.schedule()
    assert [r.request_id for r in scheduled.new_requests] == ["req0", "req1", "req2", "req3"]
    assert scheduled.num_scheduled_tokens == {"req0": 10, "req1": 10, "req2": 10, "req3": 10}
    assert scheduled.new_requests[0].block_ids == [0] and scheduled.new_requests[0].num_computed_tokens == 0
    worker = FakeWorker(scheduler)
    scheduler.update_from_output(scheduled, worker.execute(scheduled))
    outputs = run_to_completion(scheduler, worker)
    for request_outputs in outputs.values():
        assert len(output_token_ids(request_outputs)) == 15
        assert request_outputs[-1].finish_reason == "length"
        assert all(output.finish_reason is None for output in request_outputs[:-1])


def test_cached_request_data_carries_only_changes():
    scheduler = create_scheduler(block_size=4)
    add_requests(scheduler, create_requests(1, 7))
    worker = FakeWorker(scheduler, sample={"req0": [50, 51, 52]})
    step(scheduler, worker)
    scheduled, _ = step(scheduler, worker)
    (cached,) = scheduled.cached_requests
    assert (cached.new_token_ids, cached.new_block_ids, cached.num_computed_tokens) == ([50], [], 7)
    scheduled, _ = step(scheduler, worker)
    assert scheduled.cached_requests[0].new_token_ids == [51] and scheduled.cached_requests[0].new_block_ids == [2]
    scheduler.abort_requests(["req0"])
    run_to_completion(scheduler, worker)


def test_chunked_prefill_splits_a_long_prompt_under_the_budget():
    scheduler = create_scheduler(max_num_batched_tokens=32)
    add_requests(scheduler, create_requests(1, 100, max_tokens=2))
    worker = FakeWorker(scheduler)
    chunks = []
    for _ in range(4):
        scheduled, outputs = step(scheduler, worker)
        chunks.append(scheduled.num_scheduled_tokens["req0"])
        assert (outputs == []) == (len(chunks) < 4)
    assert chunks == [32, 32, 32, 4]
    run_to_completion(scheduler, worker)


def test_chunked_prefill_shares_the_budget_with_decodes_which_go_first():
    scheduler = create_scheduler(max_num_batched_tokens=32, scheduling_policy="priority")
    add_requests(scheduler, create_requests(1, 8, max_tokens=50, priorities=[1], id_prefix="decode"))
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    add_requests(scheduler, create_requests(1, 100, max_tokens=1, priorities=[0], id_prefix="prefill"))
    outputs_seen = [step(scheduler, worker)[0] for _ in range(4)]
    # The higher-priority prompt runs first and takes whole budgets; its last chunk
    # leaves room for the decode, which the batch order puts first.
    assert [list(scheduled.num_scheduled_tokens.items()) for scheduled in outputs_seen] == [
        [("decode0", 1), ("prefill0", 31)],
        [("prefill0", 32)],
        [("prefill0", 32)],
        [("decode0", 1), ("prefill0", 5)],
    ]
    run_to_completion(scheduler, worker)


def test_without_chunked_prefill_a_prompt_that_does_not_fit_waits():
    scheduler = create_scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False, max_model_len=32)
    add_requests(scheduler, create_requests(2, 20, max_tokens=3))
    worker = FakeWorker(scheduler)
    scheduled, _ = step(scheduler, worker)
    assert scheduled.num_scheduled_tokens == {"req0": 20}
    scheduled, _ = step(scheduler, worker)
    assert scheduled.num_scheduled_tokens == {"req0": 1, "req1": 20}
    run_to_completion(scheduler, worker)


def test_max_num_seqs_is_respected():
    scheduler = create_scheduler(max_num_seqs=2)
    add_requests(scheduler, create_requests(5, 10, max_tokens=3))
    worker = FakeWorker(scheduler)
    scheduled, _ = step(scheduler, worker)
    assert set(scheduled.num_scheduled_tokens) == {"req0", "req1"}
    assert scheduler.make_stats().num_waiting == 3
    outputs = run_to_completion(scheduler, worker)
    assert len(outputs) == 5


# ---- preemption --------------------------------------------------------------------------


def test_preempted_request_resumes_with_its_outputs():
    scheduler = create_scheduler(num_blocks=4, max_model_len=64)
    add_requests(scheduler, create_requests(2, 24, max_tokens=20))
    worker = FakeWorker(scheduler, sample=counting_sampler(scheduler))
    outputs_seen = []
    outputs: dict[str, list] = {}
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        scheduled, step_outputs = step(scheduler, worker)
        outputs_seen.append(scheduled)
        for output in step_outputs:
            outputs.setdefault(output.request_id, []).append(output)
    preempted_at = next(i for i, scheduled in enumerate(outputs_seen) if "req1" in scheduled.finished_request_ids)
    # req0 needs a third block once its 33rd token is computed: req1, the latest, makes room.
    assert outputs_seen[preempted_at].num_scheduled_tokens == {"req0": 1}
    assert scheduler.num_preemptions == 1
    resumed = next(r for scheduled in outputs_seen[preempted_at:] for r in scheduled.new_requests if r.request_id == "req1")
    num_outputs_before = len(output_token_ids(outputs["req1"][: preempted_at]))
    assert resumed.output_token_ids == [1000 + k for k in range(num_outputs_before)]
    assert resumed.num_computed_tokens % 16 == 0
    for request_id in ("req0", "req1"):
        assert output_token_ids(outputs[request_id]) == [1000 + k for k in range(20)]
        assert outputs[request_id][-1].finish_reason == "length"
    assert outputs["req1"][-1].num_cached_tokens == 0


def test_a_request_that_cannot_be_admitted_stays_waiting():
    scheduler = create_scheduler(num_blocks=4, max_model_len=64)
    add_requests(scheduler, create_requests(2, 40, max_tokens=2))
    worker = FakeWorker(scheduler)
    scheduled, _ = step(scheduler, worker)
    assert set(scheduled.num_scheduled_tokens) == {"req0"}
    assert scheduler.requests["req1"].status == RequestStatus.WAITING
    run_to_completion(scheduler, worker)


def test_priority_policy_preempts_the_lowest_priority_request():
    scheduler = create_scheduler(num_blocks=4, max_model_len=64, scheduling_policy="priority")
    add_requests(scheduler, create_requests(2, 24, max_tokens=20, priorities=[5, 0]))
    worker = FakeWorker(scheduler)
    preempted = []
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        scheduled, _ = step(scheduler, worker)
        preempted += [rid for rid in scheduled.finished_request_ids if rid in scheduler.requests]
    assert preempted == ["req0"]  # arrived first, but its priority value is higher


def test_priority_policy_admits_lower_values_first_then_by_arrival():
    scheduler = create_scheduler(max_num_seqs=1, scheduling_policy="priority")
    add_requests(scheduler, create_requests(4, 10, max_tokens=1, priorities=[2, 0, 1, 0]))
    worker = FakeWorker(scheduler)
    order = []
    while scheduler.has_unfinished_requests():
        scheduled, _ = step(scheduler, worker)
        order += [r.request_id for r in scheduled.new_requests]
    assert order == ["req1", "req3", "req2", "req0"]
    run_to_completion(scheduler, worker)


def test_fcfs_policy_ignores_priority():
    scheduler = create_scheduler(max_num_seqs=1)
    add_requests(scheduler, create_requests(3, 10, max_tokens=1, priorities=[2, 0, 1]))
    worker = FakeWorker(scheduler)
    order = []
    while scheduler.has_unfinished_requests():
        scheduled, _ = step(scheduler, worker)
        order += [r.request_id for r in scheduled.new_requests]
    assert order == ["req0", "req1", "req2"]
    run_to_completion(scheduler, worker)


# ---- aborts ------------------------------------------------------------------------------


def test_abort_a_waiting_request():
    scheduler = create_scheduler(max_num_seqs=1)
    add_requests(scheduler, create_requests(2, 10, max_tokens=3))
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    scheduler.abort_requests(["req1"])
    scheduled, outputs = step(scheduler, worker)
    assert "req1" not in scheduled.finished_request_ids  # the workers never saw it
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs if o.request_id == "req1"] == [
        ("req1", "abort", [])
    ]
    run_to_completion(scheduler, worker)


def test_abort_mid_prefill_frees_blocks_at_once():
    scheduler = create_scheduler(max_num_batched_tokens=32, num_blocks=20)
    add_requests(scheduler, create_requests(1, 100))
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    assert scheduler.kv_cache_manager.num_free_blocks == 18
    scheduler.abort_requests(["req0"])
    assert scheduler.kv_cache_manager.num_free_blocks == 20
    assert not scheduler.has_unfinished_requests() and scheduler.has_finished_requests()
    scheduled, outputs = step(scheduler, worker)
    assert scheduled.finished_request_ids == ["req0"] and scheduled.num_scheduled_tokens == {}
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("req0", "abort")]
    assert not scheduler.has_finished_requests()
    run_to_completion(scheduler, worker)


def test_abort_while_the_step_runs():
    scheduler = create_scheduler()
    add_requests(scheduler, create_requests(2, 10))
    worker = FakeWorker(scheduler)
    scheduled = scheduler.schedule()
    runner_output = worker.execute(scheduled)
    scheduler.abort_requests(["req0"])
    outputs = scheduler.update_from_output(scheduled, runner_output)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("req0", "abort"), ("req1", None)]
    scheduler.abort_requests(["req1"])
    run_to_completion(scheduler, worker)


def test_abort_a_preempted_request_and_unknown_ids():
    scheduler = create_scheduler(num_blocks=4, max_model_len=64)
    add_requests(scheduler, create_requests(2, 24, max_tokens=20))
    worker = FakeWorker(scheduler)
    while scheduler.num_preemptions == 0:
        step(scheduler, worker)
    assert scheduler.requests["req1"].status == RequestStatus.PREEMPTED
    scheduler.abort_requests(["req1", "no-such-request"])
    scheduler.abort_requests("req1")  # already gone: ignored
    outputs = run_to_completion(scheduler, worker)
    assert outputs["req1"][-1].finish_reason == "abort"
    assert outputs["req0"][-1].finish_reason == "length"


def test_abort_a_decoding_request_in_a_batch():
    scheduler = create_scheduler(num_blocks=10, max_model_len=160)
    add_requests(scheduler, create_requests(3, 20, max_tokens=30))
    worker = FakeWorker(scheduler)
    for _ in range(5):
        step(scheduler, worker)
    free_before = scheduler.kv_cache_manager.num_free_blocks
    scheduler.abort_requests(["req1"])
    assert scheduler.kv_cache_manager.num_free_blocks == free_before + 2
    outputs = run_to_completion(scheduler, worker)
    assert outputs["req1"][0].finish_reason == "abort"
    assert outputs["req0"][-1].finish_reason == outputs["req2"][-1].finish_reason == "length"
    assert scheduler.requests == {}


# ---- prefix caching ----------------------------------------------------------------------


def test_second_request_sharing_a_64_token_prefix_reports_64_cached_tokens():
    scheduler = create_scheduler(block_size=16)
    prefix = list(range(100, 164))
    first = create_requests(1, prompt=prefix + [1, 3, 4], id_prefix="first")
    second = create_requests(1, prompt=prefix + [5, 6, 7, 8], id_prefix="second")
    add_requests(scheduler, first)
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    add_requests(scheduler, second)
    scheduled, outputs = step(scheduler, worker)
    (new,) = scheduled.new_requests
    assert new.num_computed_tokens == 64 and scheduled.num_scheduled_tokens["second0"] == 4
    assert new.block_ids[:4] == scheduler.kv_cache_manager.get_block_ids("first0")[:4]
    assert next(o for o in outputs if o.request_id == "second0").num_cached_tokens == 64
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (67 + 68, 64)
    assert scheduler.make_stats().prefix_cache_queries == 0  # counts since the last stats
    outputs = run_to_completion(scheduler, worker)
    assert outputs["second0"][-1].num_cached_tokens == 64


def test_a_prompt_equal_to_a_cached_one_still_computes_its_last_block():
    scheduler = create_scheduler(block_size=16)
    prefix = list(range(100, 164))
    add_requests(scheduler, create_requests(1, prompt=prefix, max_tokens=1, id_prefix="a"))
    worker = FakeWorker(scheduler)
    run_to_completion(scheduler, worker)
    add_requests(scheduler, create_requests(1, prompt=prefix, max_tokens=1, id_prefix="b"))
    scheduled, outputs = step(scheduler, worker)
    assert scheduled.new_requests[0].num_computed_tokens == 48 and scheduled.num_scheduled_tokens == {"b0": 16}
    assert outputs[0].num_cached_tokens == 48
    run_to_completion(scheduler, worker)


# ---- stops and outputs ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sampling_kwargs", "sampled", "finish_reason", "stop_reason", "num_outputs"),
    [
        ({}, [5, EOS_TOKEN_ID], "stop", None, 2),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS_TOKEN_ID] * 3, "length", None, 3),
        ({"stop_token_ids": [42]}, [5, 42], "stop", 42, 2),
        ({"min_tokens": 3, "stop_token_ids": [42]}, [42, EOS_TOKEN_ID, 42], "stop", 42, 3),
        ({"max_tokens": 4}, [5] * 10, "length", None, 4),
        ({"max_tokens": None}, [5] * 100, "length", None, 6),  # max_model_len 16, prompt 10
    ],
)
def test_stop_conditions(sampling_kwargs, sampled, finish_reason, stop_reason, num_outputs):
    scheduler = create_scheduler(max_model_len=16)
    kwargs = {"max_tokens": 16, **sampling_kwargs}
    add_requests(scheduler, create_requests(1, 10, **kwargs))
    outputs = run_to_completion(scheduler, FakeWorker(scheduler, sample={"req0": list(sampled)}))["req0"]
    assert output_token_ids(outputs) == sampled[:num_outputs]
    assert (outputs[-1].finish_reason, outputs[-1].stop_reason) == (finish_reason, stop_reason)


def test_finished_request_frees_its_blocks_in_the_same_update():
    scheduler = create_scheduler(num_blocks=10, max_model_len=160)
    add_requests(scheduler, create_requests(1, 20))
    worker = FakeWorker(scheduler, sample={"req0": [EOS_TOKEN_ID]})
    _, outputs = step(scheduler, worker)
    assert outputs[0].finish_reason == "stop"
    assert scheduler.kv_cache_manager.num_free_blocks == 10
    scheduled, _ = step(scheduler, worker)
    assert scheduled.finished_request_ids == ["req0"]


def test_logprobs_and_prompt_logprobs_are_attached_once():
    scheduler = create_scheduler(max_num_batched_tokens=16)
    (request,) = add_requests(scheduler, create_requests(1, 40, max_tokens=2, prompt_logprobs=1, logprobs=0))
    worker = FakeWorker(scheduler)
    outputs = []
    while scheduler.has_unfinished_requests():
        outputs += step(scheduler, worker, with_logprobs=True)[1]
    first, second = outputs
    assert [lp.token_ids[0] for lp in first.prompt_logprobs] == request.prompt_token_ids[1:]
    assert first.new_logprobs[0].token_ids == first.new_token_ids
    assert second.prompt_logprobs is None and second.new_logprobs is not None
    run_to_completion(scheduler, worker)


# ---- boundaries and bookkeeping -------------------------------------------------------------


def test_add_request_refuses_requests_that_could_never_run():
    scheduler = create_scheduler(max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)
    add_requests(scheduler, create_requests(1, 10))
    with pytest.raises(ValueError, match="already in use"):
        add_requests(scheduler, create_requests(1, 10))
    with pytest.raises(ValueError, match="the prompt is empty"):
        add_requests(scheduler, create_requests(1, 0, id_prefix="empty"))
    with pytest.raises(ValueError, match="maximum context length is 64 tokens. However, your prompt has 64 tokens"):
        add_requests(scheduler, create_requests(1, 64, id_prefix="long"))
    with pytest.raises(ValueError, match="chunked prefill off"):
        add_requests(scheduler, create_requests(1, 33, id_prefix="unchunked"))
    scheduler.abort_requests(["req0"])
    run_to_completion(scheduler)


def test_configs_must_be_resolved_and_the_cache_must_hold_one_full_request():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(SchedulerConfig(), CacheConfig(enable_prefix_caching=True), 64, 100, None)
    with pytest.raises(ValueError, match="max_model_len"):
        create_scheduler(num_blocks=4, block_size=16, max_model_len=65)


def test_empty_step_and_stats():
    scheduler = create_scheduler(num_blocks=10, max_model_len=160)
    scheduled = scheduler.schedule()
    assert scheduled.total_num_scheduled_tokens == 0 and scheduled.step_id == 1
    assert scheduler.update_from_output(scheduled, empty_runner_output(scheduled)) == []
    add_requests(scheduler, create_requests(3, 20, max_tokens=4))
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    stats = scheduler.make_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_free_blocks, stats.num_total_blocks) == (3, 0, 4, 10)
    assert stats.kv_cache_usage == pytest.approx(0.6) and stats.step_counter == 2
    assert scheduler.get_num_unfinished_requests() == 3
    run_to_completion(scheduler, worker)
    assert scheduler.get_num_unfinished_requests() == 0
