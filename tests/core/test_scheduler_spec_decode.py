"""The scheduler's half of speculative decoding: drafts for requests with one token left to
compute, bounded by what the request and the step can use; only kept drafts count as computed."""
from __future__ import annotations

from fleet.config.speculative import SpeculativeConfig
from fleet.core.messages import ModelRunnerOutput
from fleet.core.request import RequestStatus
from fleet.core.sampling_params import StructuredOutputsParams
from fleet.tests.core.scheduler_factories import EOS_TOKEN_ID, add_requests, create_requests, create_scheduler

NGRAM = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=2, prompt_lookup_max=3).resolve()
REPEATING = [11, 12, 13, 11, 12, 13, 11, 12]


def run(scheduler, sampled: dict[str, list[int]]):
    """One step whose model outputs `sampled` for each request that reaches its last token."""
    scheduled = scheduler.schedule()

    def completes(request_id: str) -> bool:
        request = scheduler.requests[request_id]
        num_tokens = scheduled.num_scheduled_tokens[request_id] - len(scheduled.spec_token_ids.get(request_id, []))
        return request.num_computed_tokens + num_tokens == request.num_tokens

    ids = [i for i in sampled if i in scheduled.num_scheduled_tokens and completes(i)]
    output = ModelRunnerOutput(scheduled.step_id, ids, [sampled[i] for i in ids])
    return scheduled, scheduler.update_from_output(scheduled, output)


def test_drafts_follow_the_last_token_and_only_kept_ones_count_as_computed():
    scheduler = create_scheduler(block_size=4, speculative=NGRAM)
    (request,) = add_requests(scheduler, create_requests(1, prompt=REPEATING, max_tokens=12))
    scheduled, _ = run(scheduler, {"req0": [13]})
    assert scheduled.num_scheduled_tokens == {"req0": 8} and not scheduled.spec_token_ids  # the prompt: no drafts

    scheduled, (output,) = run(scheduler, {"req0": [11, 12, 99]})  # two drafts kept, then the model's own
    assert scheduled.spec_token_ids == {"req0": [11, 12, 13]}
    assert scheduled.num_scheduled_tokens == {"req0": 4}
    assert len(scheduler.kv_cache_manager.get_block_ids("req0")) * 4 >= 9 + 3
    assert output.new_token_ids == [11, 12, 99]
    assert request.output_token_ids == [13, 11, 12, 99]
    assert (request.num_computed_tokens, request.num_tokens) == (11, 12)  # 99 has no KV yet
    assert scheduler.spec_decode_totals.num_draft_tokens == 3 and scheduler.spec_decode_totals.num_accepted_tokens == 2
    scheduler.abort_requests("req0")


def test_no_more_drafts_than_the_request_can_output_or_the_step_can_hold():
    scheduler = create_scheduler(block_size=4, speculative=NGRAM)
    (request,) = add_requests(scheduler, create_requests(1, prompt=REPEATING, max_tokens=3))
    run(scheduler, {"req0": [13]})
    scheduled, _ = run(scheduler, {"req0": [11, 12]})  # 1 of 3 outputs so far: one draft, one token of its own
    assert scheduled.spec_token_ids == {"req0": [11]}
    assert request.status == RequestStatus.FINISHED_LENGTH and request.output_token_ids == [13, 11, 12]

    small_steps = create_scheduler(block_size=4, speculative=NGRAM, max_num_batched_tokens=3)
    add_requests(small_steps, create_requests(1, prompt=REPEATING, max_tokens=10))
    for _ in range(3):  # the prompt, 3 tokens a step
        run(small_steps, {"req0": [13]})
    scheduled, _ = run(small_steps, {"req0": [11, 12, 13]})
    assert scheduled.spec_token_ids == {"req0": [11, 12]}  # the step's budget: the last token and two drafts
    small_steps.abort_requests("req0")


def test_constrained_requests_and_requests_without_a_repeat_take_no_drafts():
    scheduler = create_scheduler(block_size=4, speculative=NGRAM)
    choice = StructuredOutputsParams(choice=["a", "b"])
    add_requests(scheduler, create_requests(1, prompt=REPEATING, structured_outputs=choice, id_prefix="json"))
    add_requests(scheduler, create_requests(1, prompt=list(range(100, 108)), id_prefix="plain"))
    run(scheduler, {"json0": [13], "plain0": [5]})
    scheduled, _ = run(scheduler, {"json0": [11], "plain0": [6]})
    assert scheduled.num_scheduled_tokens == {"json0": 1, "plain0": 1} and not scheduled.spec_token_ids
    scheduler.abort_requests(["json0", "plain0"])


def test_a_stop_token_among_the_kept_drafts_ends_the_request_there():
    scheduler = create_scheduler(block_size=4, speculative=NGRAM)
    (request,) = add_requests(scheduler, create_requests(1, prompt=REPEATING, max_tokens=12))
    run(scheduler, {"req0": [13]})
    _, (output,) = run(scheduler, {"req0": [11, EOS_TOKEN_ID, 7]})
    assert output.new_token_ids == [11, EOS_TOKEN_ID] and output.finish_reason == "stop"
    assert request.num_computed_tokens <= request.num_tokens
