"""The scheduler's side of prefill/decode disaggregation (core/kv_transfer.py):
a prefill instance holds a finished request's blocks until they are pulled
or held too long; a decode instance admits a prompt as pulled KV plus its
last token, and computes it all when the pull fails."""
from __future__ import annotations

import time

import msgspec

from fleet.core.messages import KVTransferParams, ModelRunnerOutput
from fleet.tests.core.scheduler_factories import FakeWorker, add_requests, create_requests, create_scheduler, step

RELEASE_ADDRESS = "tcp://127.0.0.1:1"


def remote_params(num_tokens: int, request_id: str = "p0") -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, remote_request_id=request_id,
                            remote_block_ids=list(range(-(-num_tokens // 16))), remote_num_tokens=num_tokens,
                            remote_kv_addresses=["tcp://127.0.0.1:2"], remote_release_address=RELEASE_ADDRESS)


def with_kv_transfer(core_request, params: KVTransferParams):
    return msgspec.structs.replace(core_request, kv_transfer=params)


def test_a_prefill_instance_holds_a_finished_requests_blocks_until_released():
    scheduler = create_scheduler(block_size=16)
    worker = FakeWorker(scheduler)
    (core,) = create_requests(1, num_tokens=40, max_tokens=1)
    add_requests(scheduler, [with_kv_transfer(core, KVTransferParams(do_remote_decode=True))])
    _, outputs = step(scheduler, worker)
    (output,) = outputs
    block_ids = scheduler.kv_cache_manager.get_block_ids("req0")
    assert output.finish_reason == "length" and output.kv_transfer == KVTransferParams(
        do_remote_prefill=True, remote_request_id="req0", remote_block_ids=block_ids, remote_num_tokens=40)
    assert not scheduler.has_unfinished_requests() and scheduler.has_finished_requests()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks - 3
    exported = scheduler.schedule()  # the step that tells the workers
    assert exported.kv_exports == {"req0": block_ids} and exported.kv_export_releases == []
    scheduler.kv_exports.release("req0")
    scheduler.kv_exports.release("req0")  # a second release (or an unknown id) changes nothing
    assert scheduler.schedule().kv_export_releases == ["req0"]
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks


def test_blocks_nobody_pulls_are_freed_after_the_hold_timeout():
    scheduler = create_scheduler(block_size=16)
    scheduler.kv_exports.hold_timeout_s = 0.01
    (core,) = create_requests(1, num_tokens=20, max_tokens=1)
    add_requests(scheduler, [with_kv_transfer(core, KVTransferParams(do_remote_decode=True))])
    step(scheduler, FakeWorker(scheduler))
    assert scheduler.schedule().kv_exports
    time.sleep(0.02)
    assert scheduler.schedule().kv_export_releases == ["req0"]


def test_an_aborted_or_failed_prefill_holds_nothing():
    scheduler = create_scheduler(block_size=16)
    (core,) = create_requests(1, num_tokens=20, max_tokens=4)
    add_requests(scheduler, [with_kv_transfer(core, KVTransferParams(do_remote_decode=True))])
    step(scheduler, FakeWorker(scheduler))
    scheduler.abort_requests("req0")
    assert scheduler.kv_exports.num_held == 0 and not scheduler.schedule().kv_exports


def test_a_decode_instance_pulls_all_but_the_last_prompt_token():
    scheduler = create_scheduler(block_size=16)
    worker = FakeWorker(scheduler)
    (core,) = create_requests(1, num_tokens=40, max_tokens=3)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(40))])
    scheduled, outputs = step(scheduler, worker)
    (load,) = scheduled.kv_loads
    assert load.block_ids == scheduler.kv_cache_manager.get_block_ids("req0")[:3] and load.remote_first_block == 0
    assert scheduled.num_scheduled_tokens == {"req0": 1}
    assert outputs[0].new_token_ids == [7]  # the first token comes from the step that loaded
    assert scheduler.kv_releases == [(RELEASE_ADDRESS, "p0")]
    assert scheduler.make_stats().kv_transfer_tokens == 39
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        step(scheduler, worker)


def test_a_decode_instance_pulls_only_what_its_prefix_cache_lacks():
    scheduler = create_scheduler(block_size=16)
    worker = FakeWorker(scheduler)
    prompt = list(range(100, 140))
    (local,) = create_requests(1, prompt=prompt, max_tokens=1, id_prefix="local")
    add_requests(scheduler, [local])
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        step(scheduler, worker)
    (core,) = create_requests(1, prompt=prompt, max_tokens=1)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(40))])
    scheduled, _ = step(scheduler, worker)
    (load,) = scheduled.kv_loads
    assert load.remote_first_block == 2 and load.block_ids == scheduled.new_requests[0].block_ids[2:3]
    assert scheduler.make_stats().kv_transfer_tokens == 39 - 32
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        step(scheduler, worker)


def test_a_failed_load_computes_the_prompt_here_and_caches_none_of_its_blocks():
    scheduler = create_scheduler(block_size=16)
    worker = FakeWorker(scheduler)
    (core,) = create_requests(1, num_tokens=40, max_tokens=2)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(40))])
    scheduled = scheduler.schedule()
    worker._apply(scheduled)
    failed = ModelRunnerOutput(scheduled.step_id, [], [], kv_load_failed={"req0": "no KV within 1 s"})
    assert scheduler.update_from_output(scheduled, failed) == []
    assert scheduler.kv_releases == [(RELEASE_ADDRESS, "p0")]
    assert scheduler.make_stats().kv_transfer_failures == 1
    assert scheduler.kv_cache_manager.block_pool.get_cached_block(scheduler.requests["req0"].block_hashes[0]) is None
    scheduled, _ = step(scheduler, worker)
    assert scheduled.num_scheduled_tokens == {"req0": 40} and not scheduled.kv_loads
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        step(scheduler, worker)
    assert scheduler.kv_releases == [(RELEASE_ADDRESS, "p0")]  # released once


def test_a_remote_prefill_aborted_while_waiting_is_released():
    scheduler = create_scheduler(block_size=16)
    (core,) = create_requests(1, num_tokens=40)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(40))])
    scheduler.abort_requests("req0")
    assert scheduler.kv_releases == [(RELEASE_ADDRESS, "p0")]
    scheduler.update_from_output(scheduler.schedule(), ModelRunnerOutput(scheduler.step_counter, [], []))
