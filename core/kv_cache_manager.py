"""The paged KV cache, as bookkeeping: which block holds which tokens of whom.

Pure Python: block ids in, block ids out; the tensors live in the workers.

Prefix caching: a full block is known by the hash of (its parent's hash, its
token ids). A block whose last user finished keeps its hash and stays in the
cache while it sits in the free pool; it is only evicted (least recently freed
first) when no never-cached block is left to hand out.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from typing import TYPE_CHECKING

from fleet.core.request import BlockHash

if TYPE_CHECKING:
    from fleet.core.request import Request


class KVCacheBlock:
    """One block of `block_size` token slots."""

    __slots__ = ("block_id", "ref_count", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        """Requests holding this block; 0 means it is in the free pool."""
        self.block_hash: BlockHash | None = None
        """Set once the block is full and registered in the prefix cache."""

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "uncached"
        return f"KVCacheBlock({self.block_id}, ref_count={self.ref_count}, {cached})"


class BlockPool:
    """Fixed set of blocks: a free pool, reference counts and the prefix-cache map.

    Free blocks live in two places: `_free_uncached` (nothing worth keeping) and
    `_free_cached` (hold a registered hash, in LRU order, oldest first). Allocation
    drains the first before evicting from the second.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        assert num_blocks > 0, f"{num_blocks=} must be positive"
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self._free_uncached: deque[KVCacheBlock] = deque(self.blocks)
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self._cached_blocks: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self._cached_blocks.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (caller checked num_free_blocks), ref_count 1 each."""
        assert num_blocks <= self.num_free_blocks, f"{num_blocks=} > {self.num_free_blocks=}"
        taken = []
        for _ in range(num_blocks):
            if self._free_uncached:
                block = self._free_uncached.popleft()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """One more holder for each block (prefix-cache hits); free ones leave the pool."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free_cached[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVCacheBlock]) -> None:
        """One holder fewer for each block. Blocks reaching 0 enter the free pool in the
        order given: among cached ones, the first given is the first evicted."""
        for block in blocks:
            assert block.ref_count > 0, f"double free of {block}"
            block.ref_count -= 1
            if block.ref_count > 0:
                continue
            if block.block_hash is not None:
                self._free_cached[block.block_id] = block
            else:
                self._free_uncached.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full, computed block. If another block already holds the same
        tokens (two requests computed one prefix at once), the first one stays the cached one."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self._cached_blocks:
            return
        block.block_hash = block_hash
        self._cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every hash; blocks in use keep their contents and holders."""
        for block in self._cached_blocks.values():
            block.block_hash = None
        self._cached_blocks.clear()
        self._free_uncached.extend(self._free_cached.values())
        self._free_cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None and self._cached_blocks.get(block.block_hash) is block
        del self._cached_blocks[block.block_hash]
        block.block_hash = None

    def check_invariants(self) -> None:
        """Assert that the free pool, ref counts and hash map agree (for tests)."""
        free_ids = [b.block_id for b in self._free_uncached] + list(self._free_cached)
        assert len(free_ids) == len(set(free_ids)), "a block is twice in the free pool"
        free_id_set = set(free_ids)
        for block in self.blocks:
            in_pool = block.block_id in free_id_set
            assert in_pool == (block.ref_count == 0), f"{block} free-pool membership disagrees with its ref count"
        for block in self._free_cached.values():
            assert block.block_hash is not None, f"{block} is in the cached free list without a hash"
        for block_hash, block in self._cached_blocks.items():
            assert block.block_hash == block_hash, f"{block} hash map entry is stale"


class KVCacheManager:
    """Blocks per request on top of a BlockPool.

    Token layout of one request, with the quantities allocate_slots works with:

        |<----- num_computed_tokens ----->|<- hits ->|<- num_new_tokens ->|
        | KV already in the request's blocks| prefix- | computed this step |
                                            | cache   |
        blocks needed = ceil((num_computed_tokens + hits + num_new_tokens) / block_size)

    With a sliding window over every layer, a request's leading blocks that
    no later token reads (all their keys more than the window back) go back
    to the pool ("slid out"): its KV stays bounded by the window. They stay in
    its block list, as in the workers' tables, which never read them again.

    Args:
        num_blocks: KV capacity in blocks, as the workers allocated it.
        block_size: tokens per block.
        enable_caching: prefix caching on or off.
        sliding_window: keys back every layer's attention reaches; None when some layer reaches all.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 sliding_window: int | None = None):
        assert block_size > 0, f"{block_size=} must be positive"
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self._req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_slid_out: dict[str, int] = {}
        """Leading blocks of each request returned to the pool: out of every layer's window."""
        self._num_registered_blocks: dict[str, int] = {}
        """Leading blocks of each request already offered to the prefix cache."""
        self.prefix_cache_queries = 0
        """Tokens looked up at admissions, cumulative."""
        self.prefix_cache_hits = 0
        """Tokens found at admissions, cumulative."""

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of the request's leading full blocks found in the prefix cache.

        Never the whole sequence: the last token must be computed so that the model
        yields logits, so the hit is capped at num_tokens - 1 rounded down to a block.
        Requests asking for prompt logprobs skip the cache (cached positions produce none),
        and so do embeddings by mean pooling (they need every position's hidden state).

        Returns:
            (blocks to pass to allocate_slots, number of tokens they hold)
        """
        needs_every_position = request.sampling_params.prompt_logprobs is not None or request.pooling == "mean"
        if not self.enable_caching or needs_every_position:
            return [], 0
        max_num_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_num_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVCacheBlock] | None = None
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Args:
            request: its num_computed_tokens tokens already have slots.
            num_new_tokens: tokens to compute this step.
            computed_blocks: prefix-cache hits from get_computed_blocks (admission only,
                when the request holds no block yet).

        Returns:
            The block ids added to the request (hits first, then fresh blocks), or None
            when the free pool is too small: nothing changed, the caller may preempt.
        """
        computed_blocks = computed_blocks or []
        held = self._req_blocks.get(request.request_id, [])
        self._release_slid_out(request.request_id, held, request.num_computed_tokens)
        assert not computed_blocks or not held, f"prefix hits for {request.request_id}, which holds blocks"
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        num_fresh = max(0, num_required - len(held) - len(computed_blocks))
        # Hits sitting in the free pool leave it when touched: they are not free for us.
        num_free_hits = sum(1 for block in computed_blocks if block.ref_count == 0)
        if num_fresh > self.block_pool.num_free_blocks - num_free_hits:
            return None
        if not held and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
        self.block_pool.touch(computed_blocks)
        added = computed_blocks + self.block_pool.allocate(num_fresh)
        self._req_blocks[request.request_id] = held + added
        if computed_blocks:
            self._num_registered_blocks[request.request_id] = len(computed_blocks)
        return [block.block_id for block in added]

    def _release_slid_out(self, request_id: str, held: list[KVCacheBlock], num_computed: int) -> None:
        """Return the leading blocks whose every key is out of the window of the
        next token (at position num_computed, reading keys from num_computed - window + 1 on)."""
        if not self.sliding_window or not held:
            return
        oldest_read = max(0, num_computed - self.sliding_window + 1)
        dead = min(oldest_read // self.block_size, len(held))
        released = self._num_slid_out.get(request_id, 0)
        if dead > released:
            self.block_pool.free(held[released:dead])
            self._num_slid_out[request_id] = dead

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its slid-out ones not counted)."""
        return len(self._req_blocks.get(request_id, ())) - self._num_slid_out.get(request_id, 0)

    def cache_full_blocks(self, request: Request) -> None:
        """Register the request's blocks that became full of computed tokens (prompt or output)."""
        if not self.enable_caching:
            return
        blocks = self._req_blocks.get(request.request_id, [])
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        start = self._num_registered_blocks.get(request.request_id, 0)
        for index in range(max(start, self._num_slid_out.get(request.request_id, 0)), num_full):  # held ones only
            self.block_pool.cache_block(blocks[index], request.block_hashes[index])
        self._num_registered_blocks[request.request_id] = max(start, num_full)

    def free(self, request: Request) -> None:
        """Return the request's blocks. Tail blocks go first so they are evicted first:
        a later request is likelier to share the head of a prefix than its tail."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self._num_registered_blocks.pop(request.request_id, None)
        released = self._num_slid_out.pop(request.request_id, 0)
        self.block_pool.free(blocks[released:][::-1])

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()

    def check_invariants(self) -> None:
        """Assert the pool is consistent and every held block is counted once per holder."""
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        for request_id, blocks in self._req_blocks.items():
            for block in blocks[self._num_slid_out.get(request_id, 0):]:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks:
            num_holders = holders.get(block.block_id, 0)
            assert block.ref_count == num_holders, f"{block} has {num_holders} holders"

    def assert_all_free(self) -> None:
        """The invariant after every request ended: each block is back in the free pool."""
        self.check_invariants()
        assert not self._req_blocks, f"requests still hold blocks: {sorted(self._req_blocks)}"
        assert self.num_free_blocks == self.num_blocks, f"{self.num_free_blocks=} != {self.num_blocks=}"
