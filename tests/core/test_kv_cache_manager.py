from __future__ import annotations

from fleet.core.kv_cache_manager import BlockPool, KVCacheManager
from fleet.core.request import Request
from fleet.tests.core.scheduler_factories import EOS_TOKEN_ID, create_requests

BLOCK_SIZE = 16


def make_request(prompt: list[int], request_id: str = "r", **kwargs) -> Request:
    (core_request,) = create_requests(1, prompt=prompt, id_prefix=request_id, **kwargs)
    return Request(core_request, eos_token_ids=(EOS_TOKEN_ID,), max_model_len=4096, block_size=BLOCK_SIZE)


def admit(manager: KVCacheManager, request: Request) -> list[int] | None:
    """What the scheduler does at admission: look up the prefix, allocate the rest, compute it."""
    blocks, num_computed = manager.get_computed_blocks(request)
    block_ids = manager.allocate_slots(request, request.num_tokens - num_computed, blocks)
    if block_ids is not None:
        request.start_running(num_computed)
        request.advance(request.num_tokens - num_computed)
        manager.cache_full_blocks(request)
    return block_ids


# ---- BlockPool ---------------------------------------------------------------------------


def test_pool_allocate_and_free_ref_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert [b.ref_count for b in blocks] == [1, 1, 1] and pool.num_free_blocks == 1
    assert pool.usage == 0.75
    pool.touch(blocks[:1])
    pool.free(blocks)
    assert blocks[0].ref_count == 1 and pool.num_free_blocks == 3
    pool.free(blocks[:1])
    assert pool.num_free_blocks == 4 and pool.usage == 0.0
    pool.check_invariants()


def test_pool_hands_out_uncached_blocks_before_evicting_cached_ones():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.cache_block(blocks[0], b"h0")
    pool.cache_block(blocks[1], b"h1")
    pool.free(blocks)
    taken = pool.allocate(2)
    assert {b.block_id for b in taken} == {blocks[2].block_id, blocks[3].block_id}
    assert pool.get_cached_block(b"h0") is blocks[0] and pool.get_cached_block(b"h1") is blocks[1]
    pool.free(taken)
    pool.check_invariants()


def test_pool_evicts_cached_free_blocks_least_recently_freed_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    for index, block in enumerate(blocks):
        pool.cache_block(block, f"h{index}".encode())
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    (first,) = pool.allocate(1)
    assert first is blocks[1] and first.block_hash is None and pool.get_cached_block(b"h1") is None
    (second,) = pool.allocate(1)
    assert second is blocks[0]
    assert pool.get_cached_block(b"h2") is blocks[2] and pool.num_cached_blocks == 1
    pool.free([first, second])
    pool.check_invariants()


def test_pool_touching_a_free_cached_block_takes_it_out_of_the_pool():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h")
    pool.free([block])
    assert pool.num_free_blocks == 2
    pool.touch([pool.get_cached_block(b"h")])
    assert block.ref_count == 1 and pool.num_free_blocks == 1
    (other,) = pool.allocate(1)
    assert other is not block and block.block_hash == b"h"
    pool.free([block, other])
    pool.check_invariants()


def test_pool_first_block_with_a_hash_stays_the_cached_one():
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache_block(first, b"h")
    pool.cache_block(second, b"h")
    assert pool.get_cached_block(b"h") is first and second.block_hash is None
    pool.free([first, second])
    pool.check_invariants()


def test_pool_reset_prefix_cache_forgets_hashes_but_not_holders():
    pool = BlockPool(3)
    held, freed = pool.allocate(2)
    pool.cache_block(held, b"a")
    pool.cache_block(freed, b"b")
    pool.free([freed])
    pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and held.ref_count == 1 and pool.num_free_blocks == 2
    pool.free([held])
    pool.check_invariants()


def test_pool_without_caching_registers_nothing():
    pool = BlockPool(1, enable_caching=False)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h")
    assert pool.get_cached_block(b"h") is None
    pool.free([block])


# ---- KVCacheManager --------------------------------------------------------------------


def test_allocate_slots_returns_only_new_block_ids_and_none_when_full():
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    request = make_request(list(range(100, 120)))
    assert manager.allocate_slots(request, 20) == [0, 1]
    request.start_running(0)
    request.advance(20)
    assert manager.allocate_slots(request, 12) == []
    assert manager.allocate_slots(request, 13) == [2]
    other = make_request(list(range(300, 340)), request_id="o")
    assert manager.allocate_slots(other, 40) is None
    assert manager.num_free_blocks == 1 and manager.get_block_ids(other.request_id) == []
    manager.free(request)
    manager.assert_all_free()


def test_prefix_hit_is_capped_below_the_whole_prompt():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prefix = list(range(100, 164))
    first = make_request(prefix, "a")
    assert admit(manager, first) is not None
    exact = make_request(prefix, "b")
    assert manager.get_computed_blocks(exact)[1] == 48
    longer = make_request(prefix + [7], "c")
    blocks, num_computed = manager.get_computed_blocks(longer)
    assert num_computed == 64 and [b.block_id for b in blocks] == manager.get_block_ids("a0")[:4]
    manager.free(first)
    manager.assert_all_free()


def test_prefix_hit_shares_blocks_with_a_running_request_and_counts_stats():
    manager = KVCacheManager(num_blocks=20, block_size=BLOCK_SIZE)
    prefix = list(range(100, 164))
    first, second = make_request(prefix + [1, 2], "a"), make_request(prefix + [3], "b")
    admit(manager, first)
    new_ids = admit(manager, second)
    assert new_ids[:4] == manager.get_block_ids("a0")[:4] and len(new_ids) == 5
    assert [manager.block_pool.blocks[i].ref_count for i in new_ids] == [2, 2, 2, 2, 1]
    assert second.num_cached_tokens == 64
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (66 + 65, 64)
    manager.free(first)
    manager.free(second)
    manager.assert_all_free()


def test_freed_cached_blocks_are_hit_after_the_request_ended():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    prefix = list(range(100, 164))
    first = make_request(prefix + [1], "a")
    admit(manager, first)
    manager.free(first)
    manager.assert_all_free()
    second = make_request(prefix + [2], "b")
    admit(manager, second)
    assert second.num_cached_tokens == 64
    manager.free(second)
    manager.assert_all_free()


def test_generated_tokens_fill_blocks_that_get_cached():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    first = make_request(list(range(100, 114)), "a")
    admit(manager, first)
    for token_id in (4, 5, 6):  # decode: the token sampled last step is computed this step
        first.append_output_token_ids(token_id)
        manager.allocate_slots(first, 1)
        first.advance(1)
        manager.cache_full_blocks(first)
    assert first.num_computed_tokens == 17 and manager.block_pool.num_cached_blocks == 1
    manager.free(first)
    second = make_request(first.all_token_ids + [9], "b")
    assert manager.get_computed_blocks(second)[1] == 16
    manager.assert_all_free()


def test_hits_in_the_free_pool_are_not_counted_as_free_space():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    prefix = list(range(100, 164))
    first = make_request(prefix + [1], "a")
    admit(manager, first)
    manager.free(first)
    # 4 hits sit in the free pool; the new request needs them plus 2 fresh blocks: 6 > 5.
    second = make_request(prefix + list(range(20)), "b")
    blocks, _ = manager.get_computed_blocks(second)
    assert len(blocks) == 4
    assert manager.allocate_slots(second, 20, blocks) is None
    assert all(block.ref_count == 0 for block in blocks)
    manager.assert_all_free()


def test_prompt_logprobs_requests_skip_the_prefix_cache():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prefix = list(range(100, 164))
    first = make_request(prefix + [1], "a")
    admit(manager, first)
    second = make_request(prefix + [1], "b", prompt_logprobs=1)
    assert manager.get_computed_blocks(second) == ([], 0)
    manager.free(first)
    manager.assert_all_free()


def test_caching_disabled_finds_nothing():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE, enable_caching=False)
    prefix = list(range(100, 164))
    first = make_request(prefix + [1], "a")
    admit(manager, first)
    manager.free(first)
    assert manager.get_computed_blocks(make_request(prefix + [2], "b")) == ([], 0)
    assert manager.prefix_cache_queries == 0
    manager.assert_all_free()


def test_reset_prefix_cache_then_no_hit():
    manager = KVCacheManager(num_blocks=10, block_size=BLOCK_SIZE)
    prefix = list(range(100, 164))
    first = make_request(prefix + [1], "a")
    admit(manager, first)
    manager.free(first)
    manager.reset_prefix_cache()
    assert manager.get_computed_blocks(make_request(prefix + [2], "b"))[1] == 0
    manager.assert_all_free()


def test_blocks_out_of_every_layers_window_go_back_to_the_pool():
    """Window 20 over blocks of 16: after 70 tokens the next one reads keys 51..70, in blocks 3 and 4,
    so blocks 0-2 are returned (still cached for prefix hits, still listed as the workers list them)."""
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, sliding_window=20)
    request = make_request(list(range(1, 71)))
    ids = admit(manager, request)
    assert len(ids) == 5 and manager.num_held_blocks(request.request_id) == 5
    assert manager.allocate_slots(request, 1) == []  # position 70: no new block, three released
    assert manager.num_held_blocks(request.request_id) == 2 and manager.num_free_blocks == 6
    assert manager.get_block_ids(request.request_id) == ids
    manager.check_invariants()
    again = make_request(list(range(1, 71)), request_id="again")
    blocks, num_computed = manager.get_computed_blocks(again)
    assert num_computed == 64, "the released blocks still hold their prefix"
    manager.free(request)
    manager.assert_all_free()


def test_without_a_window_over_every_layer_nothing_is_released():
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    request = make_request(list(range(1, 71)))
    admit(manager, request)
    assert manager.allocate_slots(request, 1) == [] and manager.num_held_blocks(request.request_id) == 5
