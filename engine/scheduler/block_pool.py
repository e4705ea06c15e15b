"""The paged KV block pool: free list in LRU eviction order, ref counts, prefix-cache index.

A block is *free* when no request references it (``ref_cnt == 0``). A free block may still hold a
cached, hash-addressed prefix: it stays findable until it is handed out again, and the free queue
hands out the least recently freed block first, so popular prefixes survive longest.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["BlockHash", "BlockPool", "hash_block_tokens"]

BlockHash = bytes


def hash_block_tokens(parent_hash: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Chained hash of one full block: the parent block's hash and this block's token ids.

    Chaining makes a block hash name the whole prefix up to and including the block, so equal
    hashes mean equal prefixes (up to a 128-bit collision).
    """
    digest = hashlib.blake2b(digest_size=16)
    digest.update(parent_hash if parent_hash is not None else b"root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Owns ``num_blocks`` KV blocks of ``block_size`` slots each.

    Callers pass block ids in and get block ids out; the pool alone mutates ref counts, the free
    queue and the hash index.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        # Insertion order is eviction order: the first key is handed out next.
        self._free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached ones included: they can be evicted)."""
        return len(self._free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1] (read every traced step for
        the ``kv_usage`` counter: the free count inline, one property frame fewer)."""
        return 1.0 - len(self._free_queue) / self.num_blocks

    def ref_cnt(self, block_id: int) -> int:
        return self._blocks[block_id].ref_cnt

    def block_hash(self, block_id: int) -> BlockHash | None:
        return self._blocks[block_id].block_hash

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order (first = evicted next)."""
        return list(self._free_queue)

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The cached block holding this prefix hash, or None."""
        return self._cached.get(block_hash)

    # -- mutations -----------------------------------------------------------------------------
    def allocate(self, num_blocks: int) -> list[int]:
        """Hand out ``num_blocks`` fresh blocks (ref count 1), evicting cached ones LRU-first."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, only {self.num_free_blocks} free")
        block_ids: list[int] = []
        for _ in range(num_blocks):
            block_id, _ = self._free_queue.popitem(last=False)
            block = self._blocks[block_id]
            self._evict(block)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix-cache hit); free ones leave the queue."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free_queue[block_id]
            block.ref_cnt += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference on each block, in the given order; unreferenced blocks join the
        free queue at its tail, so give the blocks you want kept longest last."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free_queue[block_id] = None

    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Index a full, confirmed block under its prefix hash. Returns False when caching is off
        or another block already holds that prefix (the duplicate stays unindexed)."""
        block = self._blocks[block_id]
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Only allowed while no block is referenced (tests, weight
        reloads); returns False and changes nothing otherwise."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: _Block) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
