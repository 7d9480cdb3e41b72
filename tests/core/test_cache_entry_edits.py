"""BlockPool's raw cache-entry edits (drop_cache_entry, add_cache_entry, get_cached_blocks) and
the manager's accept_uncached_free_hits switch (strict by default)."""

from __future__ import annotations

import pytest

from pagedkv import (
    BlockPool,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)
from pagedkv.errors import ForeignBlockError, InvalidArgumentError
from pagedkv.kv_cache_blocks import KVCacheBlocks

BLOCK_SIZE = 4
HASHER = make_request_block_hasher(BLOCK_SIZE)


def request(request_id: str, token_ids: list[int]) -> Request:
    return Request(request_id, token_ids, block_hasher=HASHER)


def cached_pool(num_blocks: int = 8, events: bool = False):
    pool = BlockPool(num_blocks, hash_block_size=BLOCK_SIZE, enable_kv_cache_events=events)
    req = request("a", list(range(12)))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(req, blocks, req.block_hashes, 0, 3, BLOCK_SIZE, 0)
    pool.take_events()
    return pool, req, blocks


def test_drop_then_add_restores_the_entry_without_events():
    pool, req, blocks = cached_pool(events=True)
    epoch = pool.eviction_epoch
    assert pool.drop_cache_entry(blocks[1]) is True
    assert blocks[1].block_hash is None
    assert pool.get_cached_block(req.block_hashes[1], [0]) is None
    assert pool.eviction_epoch == epoch + 1
    assert pool.drop_cache_entry(blocks[1]) is False  # nothing left to drop
    assert blocks[1].ref_cnt == 1  # the reference and the table are untouched
    pool.check_invariants()
    pool.add_cache_entry(blocks[1], req.block_hashes[1], 0)
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [blocks[1]]
    assert blocks[1].block_hash == req.block_hashes[1] and blocks[1].hash_group_id == 0
    pool.add_cache_entry(blocks[1], req.block_hashes[1], 0)  # already there: no change
    assert pool.take_events() == []
    pool.check_invariants()


def test_added_duplicates_come_after_the_first_and_promote_on_drop():
    pool, req, blocks = cached_pool()
    extra = pool.get_new_blocks(2)
    for block in extra:
        pool.add_cache_entry(block, req.block_hashes[0], 0)
    assert pool.get_cached_blocks(req.block_hashes[0], 0) == [blocks[0], *extra]
    assert pool.drop_cache_entry(blocks[0]) is True
    assert pool.get_cached_blocks(req.block_hashes[0], 0) == extra
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [extra[0]]
    assert pool.get_cached_blocks(b"\x01" * 32, 0) == []
    pool.check_invariants()


def test_bad_edits_are_refused_and_change_nothing():
    pool, req, blocks = cached_pool()
    other = BlockPool(8, hash_block_size=BLOCK_SIZE)
    with pytest.raises(ForeignBlockError, match="not a block of this pool"):
        pool.drop_cache_entry(other.blocks[1])
    with pytest.raises(InvalidArgumentError, match="null block"):
        pool.add_cache_entry(pool.null_block, req.block_hashes[0], 0)
    with pytest.raises(InvalidArgumentError, match="already cached under another hash"):
        pool.add_cache_entry(blocks[0], req.block_hashes[1], 0)
    (free,) = pool.get_new_blocks(1)
    with pytest.raises(InvalidArgumentError, match="group 1"):
        pool.add_cache_entry(free, req.block_hashes[0], 1)
    with pytest.raises(InvalidArgumentError, match="not bytes"):
        pool.add_cache_entry(free, "abc", 0)  # type: ignore[arg-type]
    assert free.block_hash is None
    assert pool.get_cached_blocks(req.block_hashes[0], 0) == [blocks[0]]
    pool.check_invariants()


def manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(num_blocks=10, kv_cache_groups=(KVCacheGroupSpec(("l",), spec),))
    return KVCacheManager(config, max_model_len=64)


def test_uncached_free_hits_are_refused_unless_accepted():
    strict = manager()
    head = strict.block_pool.free_block_queue.fake_free_list_head
    hits = KVCacheBlocks(([head.next_free_block, head.next_free_block.next_free_block],))
    with pytest.raises(ForeignBlockError, match="not cached under request"):
        strict.allocate_slots(request("r", list(range(12))), 4, 8, hits)
    assert strict.block_pool.get_num_free_blocks() == 9
    with pytest.raises(InvalidArgumentError, match="accept must be a bool"):
        strict.accept_uncached_free_hits(1)  # type: ignore[arg-type]

    lenient = manager()
    lenient.accept_uncached_free_hits(True)
    head = lenient.block_pool.free_block_queue.fake_free_list_head
    first, second = head.next_free_block, head.next_free_block.next_free_block
    req = request("r", list(range(12)))
    new = lenient.allocate_slots(req, 4, 8, KVCacheBlocks(([first, second],)))
    assert new is not None and new.get_block_ids() == ([3],)
    assert lenient.get_block_ids("r") == ([1, 2, 3],)
    assert (first.ref_cnt, second.ref_cnt) == (1, 1)
    # Adopted as computed: never entered into the cache for the request.
    assert first.block_hash is None and second.block_hash is None
    lenient.free(req)
    assert lenient.block_pool.get_num_free_blocks() == 9
    lenient.block_pool.check_invariants()
