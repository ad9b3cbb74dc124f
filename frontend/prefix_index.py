"""What one replica's prefix cache is believed to hold, for cache-aware
routing (frontend/load_balancer.py).

A prompt's full KV blocks are named by the engine's own chained hashes
(core/request.py: sha256 of the parent's hash and the block's tokens), so
equal hashes mean equal prefixes, and the blocks the front end names are the
blocks the engine caches. The front end never sees the engine's cache; it
remembers the blocks of the prompts sent to the replica, the newest last,
and forgets the oldest beyond the replica's KV capacity: by then the engine
has surely evicted them (it evicts the least recently freed first).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from fleet.core.request import ROOT_BLOCK_HASH, BlockHash, hash_block_tokens


def prompt_block_hashes(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[BlockHash]:
    """The chained hashes of the prompt's full blocks, as the engine's prefix cache
    computes them; at most `limit` (the first ones)."""
    num_blocks = len(token_ids) // block_size
    if limit is not None:
        num_blocks = min(num_blocks, limit)
    hashes: list[BlockHash] = []
    parent = ROOT_BLOCK_HASH
    for start in range(0, num_blocks * block_size, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """The block hashes one replica is believed to hold, least recently sent
    first, at most `capacity` of them. Not thread-safe: the balancer locks."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"a prefix index holds at least one block, got {capacity=}")
        self.capacity = capacity
        self._blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._blocks

    def match(self, hashes: Sequence[BlockHash]) -> int:
        """How many of a prompt's blocks, from the first on, the replica holds:
        the prefix its prefix cache can skip (a later block helps only after all before it)."""
        blocks = self._blocks
        for count, block_hash in enumerate(hashes):
            if block_hash not in blocks:
                return count
        return len(hashes)

    def add(self, hashes: Sequence[BlockHash]) -> None:
        """A prompt of these blocks went to the replica. They are touched last
        to first, so that a prompt's first blocks are its newest: the engine
        evicts a finished request's tail blocks first (core/kv_cache_manager.py),
        and a prefix without its first block is worth nothing."""
        blocks = self._blocks
        for block_hash in reversed(hashes):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def clear(self) -> None:
        """The replica's cache is gone (it died, or came back empty)."""
        self._blocks.clear()
