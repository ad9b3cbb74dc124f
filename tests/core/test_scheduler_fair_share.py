"""Fair share between groups (the n sequences of one user request): a small request gets in
within a few steps while n=64 requests fill the batch, groups split the batch evenly,
the priority policy still goes by priority first, and no request is lost on the way."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from fleet.core.messages import EngineCoreRequest, EngineInput
from fleet.core.request import Request
from fleet.core.request_queue import FCFSQueue
from fleet.core.sampling_params import SamplingParams
from fleet.core.scheduler import Scheduler
from fleet.core.serial import Decoder, encode
from fleet.frontend.output_processor import child_requests
from fleet.tests.core.scheduler_factories import (
    FakeWorker,
    add_requests,
    create_requests,
    create_scheduler,
    output_token_ids,
    run_to_completion,
    step,
)


def add_group(
    scheduler: Scheduler, request_id: str, n: int, *, num_tokens: int = 10, max_tokens: int = 200,
    arrival_time: float = 0.0, priority: int = 0,
) -> list[Request]:
    """One user request of n sequences, split the way the front end splits it."""
    first_token = 100 + sum(map(ord, request_id)) % 50 * num_tokens
    prompt = list(range(first_token, first_token + num_tokens))
    params = SamplingParams(n=n, max_tokens=max_tokens)
    return add_requests(scheduler, child_requests(request_id, prompt, params, arrival_time, 0, priority))


def running_per_group(scheduler: Scheduler) -> dict[str, int]:
    return dict(Counter(request.group_id for request in scheduler.running))


def finish_by_abort(scheduler: Scheduler, worker: FakeWorker) -> None:
    scheduler.abort_requests(list(scheduler.requests))
    run_to_completion(scheduler, worker)


def seq_bound_scheduler(policy: str = "fcfs") -> Scheduler:
    return create_scheduler(max_num_seqs=32, scheduling_policy=policy)


def kv_bound_scheduler(policy: str = "fcfs") -> Scheduler:
    """96 blocks of 4 tokens: about 16 of the big sequences at a time, far below max_num_seqs."""
    return create_scheduler(max_num_seqs=256, block_size=4, num_blocks=96, max_model_len=256, scheduling_policy=policy)


# ---- groups ----------------------------------------------------------------------------------


def test_the_sequences_of_one_request_form_a_group():
    params = SamplingParams(n=3, max_tokens=5)
    children = child_requests("chat-7", [1, 2, 3], params, 0.0, 0)
    assert [(c.request_id, c.parent_request_id) for c in children] == [
        ("chat-7#0", "chat-7"), ("chat-7#1", "chat-7"), ("chat-7#2", "chat-7")
    ]
    (single,) = child_requests("chat-8", [1, 2, 3], SamplingParams(max_tokens=5), 0.0, 0)
    assert single.parent_request_id is None
    decoded = Decoder(EngineInput, "test").decode(encode(children[1]))
    assert decoded == children[1]
    scheduler = create_scheduler()
    requests = add_requests(scheduler, [*children, single])
    assert [request.group_id for request in requests] == ["chat-7"] * 3 + ["chat-8"]
    run_to_completion(scheduler)


def test_the_queue_head_is_the_group_running_the_fewest_then_the_earliest():
    def engine_requests(core_requests: list[EngineCoreRequest]) -> list[Request]:
        return [Request(core_request, eos_token_ids=(), max_model_len=64) for core_request in core_requests]

    queue = FCFSQueue()
    big = engine_requests(child_requests("big", [1], SamplingParams(n=3), 0.0, 0))
    (small,) = engine_requests(create_requests(1, 2, id_prefix="small"))
    for request in (*big, small):
        queue.add(request)
    assert queue.peek() is big[0]  # nothing runs: arrival order
    queue.started_running(queue.pop())
    assert queue.peek() is small  # big runs one, small none
    queue.started_running(queue.pop())
    assert queue.peek() is big[1]  # one each: arrival order again
    queue.stopped_running(big[0])
    queue.prepend(big[0])
    assert queue.peek() is big[0]  # preempted: back to the front
    queue.remove(big[0])
    assert [queue.pop(), queue.pop()] == big[1:] and len(queue) == 0


# ---- a small request among big groups ---------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("make_scheduler", [seq_bound_scheduler, kv_bound_scheduler], ids=["max_num_seqs", "kv_cache"])
def test_a_small_request_gets_in_within_three_steps_while_big_groups_run(policy, make_scheduler):
    scheduler = make_scheduler(policy)
    for index in range(4):
        add_group(scheduler, f"big{index}", 64, max_tokens=200, arrival_time=float(index))
    worker = FakeWorker(scheduler)
    for _ in range(12):
        step(scheduler, worker)
    assert scheduler.make_stats().num_waiting > 200  # the batch is full and most sequences wait
    (small,) = add_requests(scheduler, create_requests(1, 10, max_tokens=4, id_prefix="small"))
    steps_until_scheduled = None
    small_outputs = []
    for step_index in range(1, 10):
        scheduled, outputs = step(scheduler, worker)
        if steps_until_scheduled is None and "small0" in scheduled.num_scheduled_tokens:
            steps_until_scheduled = step_index
        small_outputs += [output for output in outputs if output.request_id == "small0"]
        assert any(output.request_id.startswith("big") for output in outputs), "the big groups stalled"
        if small_outputs and small_outputs[-1].finish_reason is not None:
            break
    assert steps_until_scheduled is not None and steps_until_scheduled <= 3
    assert len(output_token_ids(small_outputs)) == 4 and small_outputs[-1].finish_reason == "length"
    assert step_index <= steps_until_scheduled + 3  # one token a step once in: never preempted
    assert small.num_preemptions == 0
    finish_by_abort(scheduler, worker)


def test_without_a_group_a_small_request_waits_its_turn_as_before():
    """Many separate one-sequence requests are many groups of one: plain arrival order."""
    scheduler = create_scheduler(max_num_seqs=4)
    add_requests(scheduler, create_requests(8, 10, max_tokens=50))
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    add_requests(scheduler, create_requests(1, 10, max_tokens=4, id_prefix="small"))
    for _ in range(5):
        scheduled, _ = step(scheduler, worker)
        assert set(scheduled.num_scheduled_tokens) == {"req0", "req1", "req2", "req3"}
    assert scheduler.num_preemptions == 0
    finish_by_abort(scheduler, worker)


# ---- sharing the batch --------------------------------------------------------------------------


def test_groups_admitted_together_share_the_batch_equally():
    scheduler = seq_bound_scheduler()
    for index in range(4):
        add_group(scheduler, f"big{index}", 64, arrival_time=float(index))
    worker = FakeWorker(scheduler)
    scheduled, _ = step(scheduler, worker)
    assert [r.request_id for r in scheduled.new_requests[:5]] == ["big0#0", "big1#0", "big2#0", "big3#0", "big0#1"]
    assert running_per_group(scheduler) == {"big0": 8, "big1": 8, "big2": 8, "big3": 8}
    finish_by_abort(scheduler, worker)


def test_a_late_group_gains_a_sequence_a_step_until_it_has_half_the_batch():
    """Fair share makes room for one admission at a time: rebalancing is gradual, then stops."""
    scheduler = create_scheduler(max_num_seqs=16)
    add_group(scheduler, "early", 64)
    worker = FakeWorker(scheduler)
    for _ in range(3):
        step(scheduler, worker)
    assert running_per_group(scheduler) == {"early": 16}
    add_group(scheduler, "late", 64, arrival_time=1.0)
    for num_late in range(1, 9):
        step(scheduler, worker)
        assert running_per_group(scheduler) == {"early": 16 - num_late, "late": num_late}
    for _ in range(20):
        step(scheduler, worker)
        assert running_per_group(scheduler) == {"early": 8, "late": 8}
    assert scheduler.num_preemptions == 8
    finish_by_abort(scheduler, worker)


def test_groups_competing_for_a_small_kv_cache_stay_within_two_sequences_of_each_other():
    scheduler = kv_bound_scheduler()
    for index in range(4):
        add_group(scheduler, f"big{index}", 64, max_tokens=200, arrival_time=float(index))
    worker = FakeWorker(scheduler)
    for _ in range(200):
        step(scheduler, worker)
        counts = [running_per_group(scheduler).get(f"big{index}", 0) for index in range(4)]
        assert max(counts) - min(counts) <= 2, counts
    finish_by_abort(scheduler, worker)


# ---- priority -------------------------------------------------------------------------------------


def test_priority_policy_admits_by_priority_before_fair_share():
    scheduler = create_scheduler(max_num_seqs=4, scheduling_policy="priority")
    add_group(scheduler, "worse", 8, priority=1, arrival_time=0.0)
    add_group(scheduler, "better", 8, priority=0, arrival_time=1.0)
    worker = FakeWorker(scheduler)
    scheduled, _ = step(scheduler, worker)
    assert running_per_group(scheduler) == {"better": 4}
    finish_by_abort(scheduler, worker)


def test_fair_share_never_preempts_a_better_priority_for_a_worse_one():
    scheduler = create_scheduler(max_num_seqs=8, scheduling_policy="priority")
    add_group(scheduler, "big", 16, priority=0)
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    add_requests(scheduler, create_requests(1, 10, max_tokens=4, priorities=[1], id_prefix="small"))
    for _ in range(10):
        scheduled, _ = step(scheduler, worker)
        assert "small0" not in scheduled.num_scheduled_tokens
    assert scheduler.num_preemptions == 0
    finish_by_abort(scheduler, worker)


def test_fair_share_preempts_a_worse_priority_for_a_better_one():
    scheduler = create_scheduler(max_num_seqs=8, scheduling_policy="priority")
    add_group(scheduler, "big", 16, priority=1)
    worker = FakeWorker(scheduler)
    step(scheduler, worker)
    add_requests(scheduler, create_requests(1, 10, max_tokens=4, priorities=[0], id_prefix="small"))
    scheduled, _ = step(scheduler, worker)
    assert "small0" in scheduled.num_scheduled_tokens and scheduler.num_preemptions == 1
    assert running_per_group(scheduler) == {"big": 7, "small0": 1}
    finish_by_abort(scheduler, worker)


# ---- nothing lost -----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_random_groups_every_sequence_finishes_with_all_its_tokens(seed, policy):
    rng = random.Random(seed)
    scheduler = create_scheduler(
        max_num_batched_tokens=rng.choice([16, 64, 256]),
        max_num_seqs=rng.choice([4, 8, 16]),
        scheduling_policy=policy,
        block_size=4,
        num_blocks=40,
        max_model_len=100,
    )
    # Output k of every sequence is 1000 + k, so a wrong resume shows in the tokens.
    worker = FakeWorker(scheduler, sample=lambda rid: 1000 + scheduler.requests[rid].num_output_tokens)
    max_tokens: dict[str, int] = {}
    aborted: set[str] = set()
    outputs: dict[str, list] = {}

    def run_steps(num_steps: int) -> None:
        for _ in range(num_steps):
            for output in step(scheduler, worker)[1]:
                outputs.setdefault(output.request_id, []).append(output)

    for index in range(30):
        n = rng.choice([1, 1, 2, 4, 8, 16])
        children = child_requests(
            f"user{index}", [rng.randrange(100, 200) for _ in range(rng.randrange(1, 30))],
            SamplingParams(n=n, max_tokens=rng.randrange(1, 40)), float(index), 0, rng.randrange(3),
        )
        add_requests(scheduler, children)
        max_tokens.update((child.request_id, child.sampling_params.max_tokens) for child in children)
        if rng.random() < 0.1 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort_requests([victim])
            aborted.add(victim)
        run_steps(rng.randrange(0, 6))
    for request_id, request_outputs in run_to_completion(scheduler, worker, max_steps=20_000).items():
        outputs.setdefault(request_id, []).extend(request_outputs)
    for request_id, request_outputs in outputs.items():
        tokens = output_token_ids(request_outputs)
        assert tokens == [1000 + k for k in range(len(tokens))], request_id
        assert request_outputs[-1].finish_reason is not None
        if request_id not in aborted:
            assert len(tokens) == max_tokens[request_id], request_id
    assert set(outputs) == set(max_tokens)
