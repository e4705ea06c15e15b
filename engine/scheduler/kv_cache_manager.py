"""Per-request view of the block pool: which blocks each request holds, prefix hits, caching."""

from __future__ import annotations

from collections import Counter

from engine.request import Request
from engine.scheduler.block_pool import BlockHash, BlockPool, hash_block_tokens

__all__ = ["KVCacheManager"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the fifth book of every request: its KV block ids.

    Block ``i`` of a request holds positions ``[i * block_size, (i + 1) * block_size)``.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._pool = BlockPool(num_blocks, block_size, enable_caching)
        self._req_blocks: dict[str, list[int]] = {}
        self._req_hashes: dict[str, list[BlockHash]] = {}
        self._num_cached_blocks: dict[str, int] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def pool(self) -> BlockPool:
        """Read-only use (counts, usage); mutate only through this manager."""
        return self._pool

    @property
    def usage(self) -> float:
        return self._pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    def block_ids(self, req_id: str) -> list[int]:
        return list(self._req_blocks.get(req_id, ()))

    def num_cached_blocks(self, req_id: str) -> int:
        """Leading blocks of the request already offered to the prefix cache."""
        return self._num_cached_blocks.get(req_id, 0)

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks ``allocate_slots(request, num_new_tokens)`` would take from the pool."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        held = len(self._req_blocks.get(request.req_id, ()))
        return max(0, _cdiv(num_tokens, self.block_size) - held)

    def num_releasable_blocks(self, req_id: str) -> int:
        """Blocks that would become free if the request let go (those it alone references)."""
        held = self._req_blocks.get(req_id, ())
        return sum(1 for block_id in held if self._pool.ref_cnt(block_id) == 1)

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached full-block prefix of the request's committed tokens.

        Never the whole sequence: the last token must be computed so the step can sample, so at
        most ``num_tokens - 1`` tokens hit. Returns (block ids, number of hit tokens); takes no
        reference (``allocate_slots`` does).
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit_blocks: list[int] = []
        for block_hash in self._hashes(request, max_blocks):
            block_id = self._pool.lookup(block_hash)
            if block_id is None:
                break
            hit_blocks.append(block_id)
        return hit_blocks, len(hit_blocks) * self.block_size

    # -- mutations -----------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[int] | None = None
    ) -> list[int] | None:
        """Make the request hold blocks for positions up to
        ``num_computed_tokens + len(computed_blocks) * block_size + num_new_tokens``.

        ``computed_blocks`` are prefix hits from ``get_computed_blocks`` (admission only). Returns
        the block ids appended to the request's table (hits first), or None, changing nothing,
        when the pool cannot supply them.
        """
        if computed_blocks is None:
            held = self._req_blocks.get(request.req_id)
            num_tokens = request.num_computed_tokens + num_new_tokens
            # A running request's step mostly fits the blocks it holds: nothing to take, touch
            # or record (the general path below would come to the same empty list).
            if held and _cdiv(num_tokens, self.block_size) <= len(held):
                return []
        computed_blocks = computed_blocks or []
        held = self._req_blocks.setdefault(request.req_id, [])
        num_tokens = (
            request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        )
        num_new_blocks = max(
            0, _cdiv(num_tokens, self.block_size) - len(held) - len(computed_blocks)
        )
        # A free cached hit leaves the free queue when touched, so it competes with new blocks.
        num_free_hits = sum(1 for block_id in computed_blocks if self._pool.ref_cnt(block_id) == 0)
        if num_new_blocks + num_free_hits > self._pool.num_free_blocks:
            if not held:
                del self._req_blocks[request.req_id]
            return None
        self._pool.touch(computed_blocks)
        if not held:
            self._num_cached_blocks[request.req_id] = len(computed_blocks)
        new_blocks = computed_blocks + self._pool.allocate(num_new_blocks)
        held.extend(new_blocks)
        return new_blocks

    def allocate_next_blocks(self, requests: list[Request]) -> list[list[int]] | None:
        """``allocate_slots(request, 1)`` for each running request in order (a decode step's one
        new position each), all or nothing: None, changing nothing, when the pool cannot supply
        every block. Returns each request's new block ids."""
        block_size = self.block_size
        req_blocks = self._req_blocks
        needs = [
            max(0, _cdiv(r.num_computed_tokens + 1, block_size) - len(req_blocks[r.req_id]))
            for r in requests
        ]
        return self.take_blocks(requests, needs)

    def next_blocks_needed(self, req_ids: list[str], num_tokens: list[int]) -> list[int]:
        """Per running request, the new blocks it needs to hold positions up to ``num_tokens``
        (its frontier after the step): ``num_blocks_needed`` for many requests at once."""
        block_size = self.block_size
        req_blocks = self._req_blocks
        return [
            max(0, _cdiv(n, block_size) - len(req_blocks[req_id]))
            for req_id, n in zip(req_ids, num_tokens, strict=True)
        ]

    def take_blocks(self, requests: list[Request], needs: list[int]) -> list[list[int]] | None:
        """Give each running request ``needs[i]`` new blocks, in order (as ``allocate_slots``
        one request at a time would), all or nothing: None, changing nothing, when the pool
        cannot supply them all. Returns each request's new block ids."""
        req_blocks = self._req_blocks
        if sum(needs) > self._pool.num_free_blocks:
            return None
        taken = []
        for request, need in zip(requests, needs, strict=True):
            new_blocks = self._pool.allocate(need) if need else []
            req_blocks[request.req_id].extend(new_blocks)
            taken.append(new_blocks)
        return taken

    def cache_full_blocks(self, request: Request, num_confirmed_tokens: int) -> None:
        """Offer to the prefix cache every full block that lies entirely below
        ``num_confirmed_tokens`` (the confirmed frontier); placeholder/in-flight positions never."""
        if not self.enable_caching:
            return
        start = self._num_cached_blocks.get(request.req_id, 0)
        if num_confirmed_tokens // self.block_size <= start:
            return  # most calls: no block filled up since the last one (the bounds below only cut)
        held = self._req_blocks.get(request.req_id, [])
        num_full = min(num_confirmed_tokens, request.num_tokens) // self.block_size
        num_full = min(num_full, len(held))
        if num_full <= start:
            return
        hashes = self._hashes(request, num_full)
        for index in range(start, num_full):
            self._pool.cache(held[index], hashes[index])
        self._num_cached_blocks[request.req_id] = num_full

    def free(self, request: Request) -> None:
        """Release the request's blocks. Tail blocks are freed first so they are evicted first
        and a shared prefix stays cached longest."""
        held = self._req_blocks.pop(request.req_id, [])
        self._pool.free(reversed(held))
        self._req_hashes.pop(request.req_id, None)
        self._num_cached_blocks.pop(request.req_id, None)

    def reset_prefix_cache(self) -> bool:
        return self._pool.reset_prefix_cache()

    def check_consistency(self) -> None:
        """Debug check: every ref count equals the number of requests holding the block, and the
        free queue holds exactly the unreferenced blocks. Raises AssertionError."""
        holders = Counter(block_id for held in self._req_blocks.values() for block_id in held)
        free = set(self._pool.free_block_ids())
        for block_id in range(self._pool.num_blocks):
            ref_cnt = self._pool.ref_cnt(block_id)
            assert ref_cnt == holders[block_id], f"block {block_id}: ref {ref_cnt} != holders"
            assert (ref_cnt == 0) == (block_id in free), f"block {block_id}: free queue mismatch"

    def _hashes(self, request: Request, num_blocks: int) -> list[BlockHash]:
        """The chained hashes of the request's first ``num_blocks`` full blocks (memoised)."""
        hashes = self._req_hashes.setdefault(request.req_id, [])
        if len(hashes) < num_blocks:
            token_ids = request.all_token_ids
            size = self.block_size
            for index in range(len(hashes), num_blocks):
                parent = hashes[-1] if hashes else None
                hashes.append(
                    hash_block_tokens(parent, token_ids[index * size : (index + 1) * size])
                )
        return hashes[:num_blocks]
