"""The scheduler's side of prefill/decode disaggregation (core/kv_connector.py):
a prefill instance holds a finished request's blocks under a random transfer id
until they are pulled, held too long, or needed; a decode instance admits a
prompt as pulled KV plus its last token, lets the pull run while its other
requests step, and computes the prompt itself when the pull fails."""
from __future__ import annotations

import time

import msgspec

from fleet.config.kv_transfer import KVTransferConfig
from fleet.core.messages import KVTransferParams
from fleet.tests.core.scheduler_factories import FakeWorker, add_requests, create_requests, create_scheduler, step

RELEASE_ADDRESS = "tcp://127.0.0.1:1"
TRANSFER_ID = "ab" * 16


def kv_scheduler(**config) -> object:
    extra = {key: config.pop(key) for key in ("hold_timeout_s", "max_held_fraction") if key in config}
    return create_scheduler(block_size=16, kv_transfer=KVTransferConfig(kv_connector_extra_config=extra), **config)


def remote_params(num_tokens: int, transfer_id: str = TRANSFER_ID) -> KVTransferParams:
    return KVTransferParams(do_remote_prefill=True, transfer_id=transfer_id, remote_num_tokens=num_tokens,
                            remote_kv_addresses=["tcp://127.0.0.1:2"], remote_release_address=RELEASE_ADDRESS)


def with_kv_transfer(core_request, params: KVTransferParams):
    return msgspec.structs.replace(core_request, kv_transfer=params)


def run_to_end(scheduler, worker) -> None:
    while scheduler.has_unfinished_requests() or scheduler.has_finished_requests():
        step(scheduler, worker)


def prefill(scheduler, num_tokens: int, index: int = 0) -> KVTransferParams:
    prompt = list(range(1000 * (index + 1), 1000 * (index + 1) + num_tokens))  # no prefix shared with another
    (core,) = create_requests(1, prompt=prompt, max_tokens=1, id_prefix=f"p{index}-")
    add_requests(scheduler, [with_kv_transfer(core, KVTransferParams(do_remote_decode=True))])
    (output,) = _until_exported(scheduler)
    return output.kv_transfer


def _until_exported(scheduler) -> list:
    """The step that finishes a held prompt sends nothing: its last output (the transfer id)
    goes out after the next step, which tells the workers which blocks they may serve."""
    _, outputs = step(scheduler, worker_of(scheduler))
    assert outputs == []
    assert scheduler.has_finished_requests()  # the engine steps again, though nothing runs
    told, outputs = step(scheduler, worker_of(scheduler))
    assert [o.kv_transfer.transfer_id for o in outputs] == list(told.kv_exports)
    return outputs


def worker_of(scheduler) -> FakeWorker:
    """The one fake worker of a scheduler (it must see every step)."""
    if not hasattr(scheduler, "test_worker"):
        scheduler.test_worker = FakeWorker(scheduler)
    return scheduler.test_worker


def pulls_end(scheduler, done=(), failed=None) -> list:
    """One step in which the workers report pulls that ended."""
    scheduled = scheduler.schedule()
    worker_output = worker_of(scheduler).execute(scheduled)
    worker_output.kv_loads_done, worker_output.kv_load_failed = list(done), dict(failed or {})
    return scheduler.update_from_output(scheduled, worker_output)


def test_a_prefill_instance_holds_a_finished_requests_blocks_under_a_random_id_until_released():
    scheduler = kv_scheduler()
    params = prefill(scheduler, 40)
    other = prefill(scheduler, 40, index=1)
    assert params.do_remote_prefill and params.remote_num_tokens == 40
    assert len(params.transfer_id) == 32 and int(params.transfer_id, 16) >= 0  # 128 bits, hex
    assert params.transfer_id != other.transfer_id
    assert not scheduler.has_unfinished_requests() and not scheduler.has_finished_requests()
    kv = scheduler.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 6
    scheduler.kv_connector.release(params.transfer_id)
    scheduler.kv_connector.release(params.transfer_id)  # a second release (or an unknown id) changes nothing
    scheduler.kv_connector.release("p0-0")  # the request id is no name for it
    assert params.transfer_id in scheduler.schedule().kv_export_releases
    assert kv.num_free_blocks == kv.num_blocks - 3
    scheduler.kv_connector.release(other.transfer_id)
    scheduler.schedule()
    assert kv.num_free_blocks == kv.num_blocks


def test_an_export_tells_the_workers_which_prompt_it_holds():
    scheduler = kv_scheduler()
    (core,) = create_requests(1, num_tokens=20, max_tokens=1)
    (request,) = add_requests(scheduler, [with_kv_transfer(core, KVTransferParams(do_remote_decode=True))])
    _, outputs = step(scheduler, worker_of(scheduler))
    assert outputs == []
    told, (output,) = step(scheduler, worker_of(scheduler))
    export = told.kv_exports[output.kv_transfer.transfer_id]
    assert export.prompt_digest == request.prompt_digest() and len(export.block_ids) == 2
    scheduler.kv_connector.release(output.kv_transfer.transfer_id)
    scheduler.schedule()


def test_blocks_nobody_pulls_are_freed_after_the_hold_timeout():
    scheduler = kv_scheduler(hold_timeout_s=0.01)
    params = prefill(scheduler, 20)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not (released := scheduler.schedule().kv_export_releases):
        time.sleep(0.005)
    assert released == [params.transfer_id]


def test_held_blocks_never_exceed_their_share_of_the_cache():
    scheduler = kv_scheduler(num_blocks=20, max_held_fraction=0.5, max_model_len=320)
    transfers = [prefill(scheduler, 40, index=i).transfer_id for i in range(4)]  # 3 blocks each, 10 may be held
    scheduler.schedule()
    assert scheduler.kv_connector.exports.num_held == 3 and scheduler.kv_connector.exports.num_held_blocks == 9
    for transfer_id in transfers:
        scheduler.kv_connector.release(transfer_id)
    scheduler.schedule()


def test_held_blocks_give_way_to_a_request_of_this_instance():
    scheduler = kv_scheduler(num_blocks=20, max_held_fraction=1.0, max_model_len=320)
    for index in range(5):
        prefill(scheduler, 40, index=index)  # 15 of the 20 blocks held
    (core,) = create_requests(1, num_tokens=150, max_tokens=1)  # needs 10 blocks
    add_requests(scheduler, [core])
    scheduled, _ = step(scheduler, worker_of(scheduler))
    assert scheduled.num_scheduled_tokens == {"req0": 150}
    assert scheduler.kv_connector.exports.num_held == 3  # the two oldest went
    while scheduler.kv_connector.exports.release_oldest():
        pass
    scheduler.schedule()


def test_an_aborted_or_failed_prefill_holds_nothing():
    scheduler = kv_scheduler()
    (core,) = create_requests(1, num_tokens=20, max_tokens=4)
    add_requests(scheduler, [with_kv_transfer(core, KVTransferParams(do_remote_decode=True))])
    step(scheduler, worker_of(scheduler))
    scheduler.abort_requests("req0")
    assert scheduler.kv_connector.exports.num_held == 0 and not scheduler.schedule().kv_exports


def test_a_decode_instance_pulls_all_but_the_last_prompt_token_while_others_step():
    scheduler = kv_scheduler()
    worker = worker_of(scheduler)
    pulled, local = create_requests(2, num_tokens=40, max_tokens=3)
    add_requests(scheduler, [with_kv_transfer(pulled, remote_params(40)), local])
    request = scheduler.requests["req0"]
    scheduled, _ = step(scheduler, worker)
    (load,) = scheduled.kv_loads
    assert load.block_ids == scheduler.kv_cache_manager.get_block_ids("req0")[:3] and load.remote_first_block == 0
    assert load.transfer_id == TRANSFER_ID and load.prompt_digest == request.prompt_digest()
    assert load.consumer_id == scheduler.kv_connector.consumer_id
    assert scheduled.num_scheduled_tokens == {"req1": 40}  # the pull waits apart; the other request runs
    for _ in range(2):
        scheduled, _ = step(scheduler, worker)
        assert list(scheduled.num_scheduled_tokens) == ["req1"]
    assert request.status.name == "WAITING_FOR_REMOTE_KVS"
    assert scheduler.make_stats().num_waiting == 1
    pulls_end(scheduler, done=["req0"])
    assert scheduler.kv_connector.take_releases() == [(RELEASE_ADDRESS, TRANSFER_ID)]
    assert scheduler.make_stats().kv_transfer_tokens == 39
    scheduled, outputs = step(scheduler, worker)
    assert scheduled.num_scheduled_tokens["req0"] == 1
    assert scheduled.new_requests[0].num_computed_tokens == 39
    assert scheduled.new_requests[0].block_ids == scheduler.kv_cache_manager.get_block_ids("req0")
    assert [o.new_token_ids for o in outputs if o.request_id == "req0"] == [[7]]
    run_to_end(scheduler, worker)


def test_a_decode_instance_pulls_only_what_its_prefix_cache_lacks():
    scheduler = kv_scheduler()
    worker = worker_of(scheduler)
    prompt = list(range(100, 140))
    (local,) = create_requests(1, prompt=prompt, max_tokens=1, id_prefix="local")
    add_requests(scheduler, [local])
    run_to_end(scheduler, worker)
    (core,) = create_requests(1, prompt=prompt, max_tokens=1)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(40))])
    scheduled, _ = step(scheduler, worker)
    (load,) = scheduled.kv_loads
    assert load.remote_first_block == 2 and load.block_ids == scheduler.kv_cache_manager.get_block_ids("req0")[2:3]
    pulls_end(scheduler, done=["req0"])
    assert scheduler.make_stats().kv_transfer_tokens == 39 - 32
    run_to_end(scheduler, worker)


def test_a_failed_pull_computes_the_prompt_here_and_caches_none_of_its_blocks():
    scheduler = kv_scheduler()
    worker = worker_of(scheduler)
    (core,) = create_requests(1, num_tokens=40, max_tokens=2)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(40))])
    assert pulls_end(scheduler) == []  # the step that starts the pull
    assert pulls_end(scheduler, failed={"req0": "no KV within 1 s"}) == []
    assert scheduler.kv_connector.take_releases() == [(RELEASE_ADDRESS, TRANSFER_ID)]
    assert scheduler.make_stats().kv_transfer_failures == 1
    kv = scheduler.kv_cache_manager
    assert kv.block_pool.get_cached_block(scheduler.requests["req0"].block_hashes[0]) is None
    assert not kv.get_block_ids("req0")
    scheduled, _ = step(scheduler, worker)
    assert scheduled.num_scheduled_tokens == {"req0": 40} and not scheduled.kv_loads
    run_to_end(scheduler, worker)
    assert scheduler.kv_connector.take_releases() == []  # released once


def test_a_request_aborted_while_its_pull_runs_keeps_its_blocks_until_the_pull_ends():
    scheduler = kv_scheduler()
    (core,) = create_requests(1, num_tokens=40)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(40))])
    pulls_end(scheduler)
    scheduler.abort_requests("req0")
    kv = scheduler.kv_cache_manager
    assert len(kv.get_block_ids("req0")) == 3  # a worker may still be writing into them
    assert scheduler.has_unfinished_requests()  # the engine keeps stepping to hear the pull end
    outputs = pulls_end(scheduler, done=["req0"])
    assert [o.finish_reason for o in outputs] == ["abort"]
    assert kv.num_free_blocks == kv.num_blocks and not scheduler.has_unfinished_requests()
    assert scheduler.kv_connector.take_releases() == [(RELEASE_ADDRESS, TRANSFER_ID)]


def test_a_remote_prefill_aborted_while_waiting_is_released():
    scheduler = kv_scheduler(max_num_seqs=1)
    blocker, core = create_requests(2, num_tokens=40)
    add_requests(scheduler, [blocker, with_kv_transfer(core, remote_params(40))])
    scheduler.abort_requests("req1")
    assert scheduler.kv_connector.take_releases() == [(RELEASE_ADDRESS, TRANSFER_ID)]
    scheduler.abort_requests("req0")
    pulls_end(scheduler)


def test_params_for_another_prompt_are_computed_here_and_released():
    scheduler = kv_scheduler()
    worker = worker_of(scheduler)
    (core,) = create_requests(1, num_tokens=40, max_tokens=1)
    add_requests(scheduler, [with_kv_transfer(core, remote_params(41))])
    assert scheduler.kv_connector.take_releases() == [(RELEASE_ADDRESS, TRANSFER_ID)]
    scheduled, _ = step(scheduler, worker)
    assert scheduled.num_scheduled_tokens == {"req0": 40} and not scheduled.kv_loads
    run_to_end(scheduler, worker)
