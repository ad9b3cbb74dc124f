"""Random workloads on a small cache: preemption, chunking, shared prefixes and aborts
at random moments, with the fake worker checking every scheduler output and the pool checked every step."""
from __future__ import annotations

import random

import pytest

from fleet.tests.core.scheduler_factories import FakeWorker, create_requests, create_scheduler, output_token_ids, step


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_random_workload(seed, policy, enable_prefix_caching):
    rng = random.Random(seed)
    scheduler = create_scheduler(
        max_num_batched_tokens=rng.choice([8, 24, 64]),
        max_num_seqs=rng.choice([2, 4, 8]),
        scheduling_policy=policy,
        enable_prefix_caching=enable_prefix_caching,
        block_size=4,
        num_blocks=24,
        max_model_len=80,
    )
    # Output k of every request is 1000 + k, so a wrong resume shows in the tokens.
    worker = FakeWorker(scheduler, sample=lambda rid: 1000 + scheduler.requests[rid].num_output_tokens)
    shared_prefix = [rng.randrange(100, 200) for _ in range(12)]
    max_tokens: dict[str, int] = {}
    aborted: set[str] = set()
    outputs: dict[str, list] = {}
    for index in range(40):
        prompt = shared_prefix[: rng.randrange(0, 13)] + [rng.randrange(100, 200) for _ in range(rng.randrange(1, 30))]
        (core_request,) = create_requests(
            1, prompt=prompt, max_tokens=rng.randrange(1, 30), priorities=[rng.randrange(3)], id_prefix=f"r{index}-"
        )
        scheduler.add_request(core_request)
        max_tokens[core_request.request_id] = core_request.sampling_params.max_tokens
        for _ in range(rng.randrange(0, 4)):
            if rng.random() < 0.08 and scheduler.requests:
                victim = rng.choice(sorted(scheduler.requests))
                scheduler.abort_requests([victim])
                aborted.add(victim)
            for output in step(scheduler, worker)[1]:
                outputs.setdefault(output.request_id, []).append(output)
    for _ in range(5000):
        if not (scheduler.has_unfinished_requests() or scheduler.has_finished_requests()):
            break
        for output in step(scheduler, worker)[1]:
            outputs.setdefault(output.request_id, []).append(output)
    assert not worker.tokens
    for request_id, request_outputs in outputs.items():
        tokens = output_token_ids(request_outputs)
        assert tokens == [1000 + k for k in range(len(tokens))], request_id
        assert request_outputs[-1].finish_reason is not None
        if request_id not in aborted:
            assert len(tokens) == max_tokens[request_id]
    assert set(outputs) == set(max_tokens)
