"""CachedRequests through the steps a scheduler sends: the flat tensors of
each step, gathered from the request rows kept between steps."""
from __future__ import annotations

import torch

from fleet.core.messages import CachedRequestData, NewRequestData, SchedulerOutput
from fleet.core.sampling_params import SamplingParams
from fleet.kernels.attention import AttentionMetadata
from fleet.workers.input_batch import CachedRequests, RequestRows

BLOCK_SIZE = 4


def new(request_id: str, prompt: list[int], blocks: list[int], computed: int = 0,
        outputs: list[int] | None = None) -> NewRequestData:
    return NewRequestData(request_id, prompt, SamplingParams(), blocks, computed, output_token_ids=outputs or [])


def step(scheduled: dict[str, int], new_requests=(), cached=(), finished=(), drafts=None) -> SchedulerOutput:
    return SchedulerOutput(step_id=0, new_requests=list(new_requests), cached_requests=list(cached),
                           num_scheduled_tokens=scheduled, finished_request_ids=list(finished),
                           spec_token_ids=drafts or {})


def apply(requests: CachedRequests, output: SchedulerOutput):
    """The step's batch, whose attention metadata is also what the one builder from host lists makes."""
    requests.apply(output)
    batch = requests.build_batch(output)
    rows = [requests.rows.row_of[request_id] for request_id in output.num_scheduled_tokens]
    tables = [requests.rows.block_table[row, : requests.rows.num_blocks[row]].tolist() for row in rows]
    expected = AttentionMetadata.build(batch.attention.query_lens, batch.attention.seq_lens_list, tables, BLOCK_SIZE)
    for name, value in vars(expected).items():
        actual = getattr(batch.attention, name)
        if isinstance(value, torch.Tensor):
            assert actual.dtype == value.dtype and torch.equal(actual, value), name
        else:
            assert actual == value, name
    return batch


def values(tensor: torch.Tensor) -> list:
    return tensor.tolist()


def test_a_prefill_then_decodes_with_a_new_request_beside_them():
    requests = CachedRequests(torch.device("cpu"), BLOCK_SIZE)
    batch = apply(requests, step({"a": 5}, new_requests=[new("a", [10, 11, 12, 13, 14], [7, 3])]))
    assert values(batch.input_ids) == [10, 11, 12, 13, 14]
    assert values(batch.positions) == [0, 1, 2, 3, 4]
    assert values(batch.attention.slot_mapping) == [28, 29, 30, 31, 12]
    assert values(batch.attention.block_tables) == [[7, 3]]
    assert values(batch.attention.query_start_loc) == [0, 5]
    assert values(batch.attention.seq_lens) == [5] and batch.attention.seq_lens_list == [5]
    assert batch.attention.num_decode_seqs == 0 and not batch.attention.decodes_only

    # a decodes its sampled token; b arrives with a prefix-cache hit of one block and one block more
    batch = apply(requests, step({"a": 1, "b": 3}, new_requests=[new("b", [20, 21, 22, 23, 24, 25, 26], [5, 6], 4)],
                                 cached=[CachedRequestData("a", [15], [], 5)]))
    assert values(batch.input_ids) == [15, 24, 25, 26]
    assert values(batch.positions) == [5, 4, 5, 6]
    assert values(batch.attention.slot_mapping) == [13, 24, 25, 26]
    assert values(batch.attention.block_tables) == [[7, 3], [5, 6]]
    assert values(batch.attention.query_start_loc) == [0, 1, 4]
    assert batch.attention.seq_lens_list == [6, 7] and batch.attention.query_lens == [1, 3]
    assert batch.attention.num_decode_seqs == 1
    assert [state.request_id for state in batch.requests] == ["a", "b"]

    # a crosses into a new block; b decodes too
    apply(requests, step({"a": 1, "b": 1}, cached=[CachedRequestData("a", [16], [], 6),
                                                   CachedRequestData("b", [27], [], 7)]))
    batch = apply(requests, step({"b": 1, "a": 1}, cached=[CachedRequestData("a", [17], [9], 7),
                                                           CachedRequestData("b", [28], [8], 8)]))
    assert values(batch.input_ids) == [28, 17]
    assert values(batch.positions) == [8, 7]
    assert values(batch.attention.slot_mapping) == [8 * 4, 3 * 4 + 3]
    assert values(batch.attention.block_tables) == [[5, 6, 8], [7, 3, 9]]
    assert batch.attention.decodes_only
    assert requests.states["a"].output_token_ids == [15, 16, 17]


def test_a_finished_request_gives_its_row_to_the_last_one():
    requests = CachedRequests(torch.device("cpu"), BLOCK_SIZE)
    apply(requests, step({"a": 2, "b": 3, "c": 1}, new_requests=[
        new("a", [1, 2], [1]), new("b", [3, 4, 5], [2]), new("c", [6], [3])]))
    batch = apply(requests, step({"c": 1, "b": 1}, finished=["a"], cached=[
        CachedRequestData("b", [50], [], 3), CachedRequestData("c", [60], [], 1)]))
    assert requests.rows.request_ids == ["c", "b"]
    assert values(batch.input_ids) == [60, 50]
    assert values(batch.attention.block_tables) == [[3], [2]]
    assert "a" not in requests.states
    assert apply(requests, step({}, finished=["b", "c", "unknown"])).input_ids.numel() == 0
    assert len(requests.rows) == 0


def test_a_preempted_request_resumes_with_its_outputs():
    requests = CachedRequests(torch.device("cpu"), BLOCK_SIZE)
    apply(requests, step({"a": 3}, new_requests=[new("a", [1, 2, 3], [4])]))
    apply(requests, step({"a": 1}, cached=[CachedRequestData("a", [40], [], 3)]))
    apply(requests, step({}, finished=["a"]))  # preempted: its blocks are gone
    # resumed: prompt and outputs in full, recomputed in new blocks
    batch = apply(requests, step({"a": 5}, new_requests=[new("a", [1, 2, 3], [9, 8], outputs=[40, 41])]))
    assert values(batch.input_ids) == [1, 2, 3, 40, 41]
    assert values(batch.attention.slot_mapping) == [36, 37, 38, 39, 32]
    assert requests.states["a"].output_token_ids == [40, 41]


def test_a_chunked_prefill_continues_where_it_stopped():
    requests = CachedRequests(torch.device("cpu"), BLOCK_SIZE)
    prompt = list(range(100, 110))
    apply(requests, step({"a": 4}, new_requests=[new("a", prompt, [0, 1, 2])]))
    batch = apply(requests, step({"a": 6}, cached=[CachedRequestData("a", [], [], 4)]))
    assert values(batch.input_ids) == prompt[4:]
    assert values(batch.positions) == list(range(4, 10))
    assert batch.attention.seq_lens_list == [10]


def test_drafts_follow_the_last_token_and_are_replaced_by_the_kept_ones():
    requests = CachedRequests(torch.device("cpu"), BLOCK_SIZE)
    apply(requests, step({"a": 3}, new_requests=[new("a", [1, 2, 3], [0, 1])]))
    batch = apply(requests, step({"a": 3}, cached=[CachedRequestData("a", [4], [], 3)], drafts={"a": [5, 6]}))
    assert values(batch.input_ids) == [4, 5, 6]
    assert values(batch.positions) == [3, 4, 5]
    assert batch.drafts == [[5, 6]]
    # the model kept draft 5 and then sampled 7: the row holds 5, 7 where the drafts were
    batch = apply(requests, step({"a": 1}, cached=[CachedRequestData("a", [5, 7], [], 5)]))
    assert values(batch.input_ids) == [7] and values(batch.positions) == [5]
    assert requests.rows.token_ids[0, :6].tolist() == [1, 2, 3, 4, 5, 7]


def test_rows_grow_past_their_first_size():
    rows = RequestRows(num_rows=1, max_tokens=2, max_blocks=1)
    rows.add("a", [1, 2, 3], [4, 5], 0)
    rows.add("b", [6], [7], 0)
    rows.update("b", [8, 9, 10], [11, 12], 1)
    assert rows.token_ids[rows.row_of["a"], :3].tolist() == [1, 2, 3]
    assert rows.token_ids[rows.row_of["b"], :4].tolist() == [6, 8, 9, 10]
    assert rows.block_table[rows.row_of["b"], :3].tolist() == [7, 11, 12]
    assert rows.block_table[rows.row_of["a"]].tolist()[:3] == [4, 5, 0]
