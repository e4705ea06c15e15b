"""BlockPool (free queue, ref counts, LRU eviction, hash index) and KVCacheManager."""

from __future__ import annotations

import pytest

from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler.block_pool import BlockPool, hash_block_tokens
from engine.scheduler.kv_cache_manager import KVCacheManager


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(
        req_id, tokens, SamplingParams(max_tokens=4), arrival_time=0.0, eos_token_id=None
    )


def test_chained_hash_names_the_whole_prefix() -> None:
    a = hash_block_tokens(None, [1, 2])
    assert a == hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(
        hash_block_tokens(None, [9, 9]), [3, 4]
    )
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_allocate_free_ref_counts_and_usage() -> None:
    pool = BlockPool(num_blocks=4, block_size=2)
    blocks = pool.allocate(3)
    assert blocks == [0, 1, 2] and pool.num_free_blocks == 1 and pool.usage == 0.75
    pool.touch([1])
    pool.free(blocks)
    assert pool.ref_cnt(1) == 1 and pool.num_free_blocks == 3
    with pytest.raises(ValueError, match="only 3 free"):
        pool.allocate(4)
    pool.free([1])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([1])


def test_lru_eviction_order_of_cached_free_blocks() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    blocks = pool.allocate(3)
    hashes = [hash_block_tokens(None, [i, i]) for i in range(3)]
    for block_id, block_hash in zip(blocks, hashes, strict=True):
        assert pool.cache(block_id, block_hash)
    pool.free([2, 0, 1])  # freed order = eviction order
    assert pool.free_block_ids() == [2, 0, 1]
    pool.touch([0])  # a prefix hit revives block 0 ...
    pool.free([0])  # ... and it becomes the most recently used
    assert pool.free_block_ids() == [2, 1, 0]
    (evicted,) = pool.allocate(1)
    assert evicted == 2 and pool.lookup(hashes[2]) is None
    assert pool.lookup(hashes[0]) == 0 and pool.lookup(hashes[1]) == 1


def test_duplicate_prefix_stays_unindexed_and_reset() -> None:
    pool = BlockPool(num_blocks=2, block_size=2)
    a, b = pool.allocate(2)
    block_hash = hash_block_tokens(None, [7, 7])
    assert pool.cache(a, block_hash) and not pool.cache(b, block_hash)
    assert not pool.reset_prefix_cache()  # blocks still referenced
    pool.free([a, b])
    assert pool.reset_prefix_cache() and pool.num_cached_blocks == 0


def test_caching_disabled_never_indexes() -> None:
    pool = BlockPool(num_blocks=2, block_size=2, enable_caching=False)
    (a,) = pool.allocate(1)
    assert not pool.cache(a, hash_block_tokens(None, [1, 1]))


def test_manager_prefix_hit_never_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    first = _request("a", list(range(12)))
    assert kv.allocate_slots(first, 12) is not None
    first.num_computed_tokens = 12
    kv.cache_full_blocks(first, 12)
    # Same 12 tokens: only 2 of 3 full blocks may hit, the last token must be computed.
    same = _request("b", list(range(12)))
    blocks, num_hit = kv.get_computed_blocks(same)
    assert num_hit == 8 and blocks == kv.block_ids("a")[:2]
    longer = _request("c", list(range(13)))
    assert kv.get_computed_blocks(longer)[1] == 12
    diverging = _request("d", [0, 1, 2, 3, 99, 5, 6, 7, 8])
    assert kv.get_computed_blocks(diverging)[1] == 4


def test_manager_caches_only_below_confirmed_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = _request("a", list(range(10)))
    kv.allocate_slots(request, 10)
    kv.cache_full_blocks(request, 7)  # frontier 7: block 0 only
    assert kv.num_cached_blocks("a") == 1
    assert kv.get_computed_blocks(_request("b", list(range(10))))[1] == 4
    kv.cache_full_blocks(request, 9)
    assert kv.num_cached_blocks("a") == 2


def test_manager_allocation_failure_changes_nothing_and_counts_free_hits() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    owner = _request("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(owner, 5)
    owner.num_computed_tokens = 5
    kv.cache_full_blocks(owner, 5)
    kv.free(owner)
    assert kv.num_free_blocks == 3 and kv.pool.num_cached_blocks == 2
    # Hits on the two free cached blocks plus one new block: exactly the pool.
    other = _request("b", [1, 2, 3, 4, 5, 6])
    hits, num_hit = kv.get_computed_blocks(other)
    assert num_hit == 4
    assert kv.allocate_slots(other, 3, hits) is None  # needs 2 new + 2 revived > 3
    assert kv.num_free_blocks == 3 and kv.block_ids("b") == []
    assert kv.allocate_slots(other, 2, hits) is not None
    assert kv.num_free_blocks == 0
    kv.check_consistency()
    kv.free(other)
    assert kv.num_free_blocks == 3
    kv.check_consistency()
