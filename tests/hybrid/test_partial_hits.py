"""Sub-block (partial) hash hits in pagedkv's own KVCacheManager (vLLM 0.33's feature).

A hybrid model whose Mamba "align" blocks are larger than a hash block may hit at any hash
boundary; a hit ending inside a block continues in a private copy. Every expected value (hit
lengths, tables, new blocks, copies, events, free-queue order) is what vLLM 0.33's own
KVCacheManager gives for the same calls (tests/integrations/test_vllm_partial_hits.py runs
those scenarios on both, side by side, in CI's vLLM venv).
"""

from __future__ import annotations

import pytest

from pagedkv import BlockRemoved, BlockStored, InvalidArgumentError, KVCacheManager
from pagedkv.block_pool import BlockPool
from pagedkv.kv_cache_blocks import KVCacheBlockCopy
from tests.support.hybrid import config, full, make_request, mamba


def make(num_blocks: int, *specs) -> KVCacheManager:
    return KVCacheManager(
        config(num_blocks, *specs),
        max_model_len=8192,
        hash_block_size=2,
        enable_kv_cache_events=True,
    )


def step(manager, request, num_new_tokens, lookup=True):
    """One scheduling: lookup, allocate, take the copies (the worker runs them) and release
    their ends; returns (hit, new block ids, copies, table)."""
    manager.new_step_starts()
    hits, num_hit = None, 0
    if lookup:
        hits, num_hit, _ = manager.get_computed_blocks(request)
    new = manager.allocate_slots(request, num_new_tokens, num_hit, hits)
    copies, retained = manager.take_kv_cache_block_copies()
    manager.check_invariants(retained)
    request.num_computed_tokens = num_hit + num_new_tokens
    manager.block_pool.free_blocks(retained)
    manager.check_invariants()
    return (
        num_hit,
        new.get_block_ids(),
        [tuple(copy) for copy in copies],
        (manager.get_block_ids(request.request_id)),
    )


def stored(events):
    return [
        (e.group_idx, e.block_size, list(e.token_ids)) for e in events if isinstance(e, BlockStored)
    ]


def test_partial_hits_need_a_mamba_group_with_blocks_above_the_hash_block():
    assert make(24, full(2), mamba(4)).coordinator.enable_partial_hash_hits
    assert not make(24, full(2), mamba(2)).coordinator.enable_partial_hash_hits
    assert not make(24, full(4), full(8)).coordinator.enable_partial_hash_hits


def test_a_hit_inside_a_mamba_block_is_copied():
    manager = make(24, full(2), mamba(4))
    producer = make_request("p", [0, 0, 1, 1, 2, 2, 3], 2)
    assert step(manager, producer, 6) == (0, ([1, 2, 3], [0, 4]), [], ([1, 2, 3], [0, 4]))
    # The state at 6 tokens sits in the Mamba block of tokens 4-7: a sub-block entry.
    assert stored(manager.take_events()) == [
        (0, 2, [0, 0, 1, 1, 2, 2]),
        (1, 4, [0, 0, 1, 1]),
        (1, 2, [2, 2]),
    ]
    state = manager.block_pool.blocks[4]
    assert (state.block_hash, state.block_hash_num_tokens) == (producer.block_hashes[2], 6)
    manager.free(producer)
    consumer = make_request("c", [0, 0, 1, 1, 2, 2, 3, 3, 4, 4], 2)
    assert step(manager, consumer, 4) == (
        6,
        ([5, 6], [7, 8]),
        [(4, 7)],  # block 4's state goes on in block 7
        ([1, 2, 3, 5, 6], [0, 7, 8]),
    )
    assert stored(manager.take_events()) == [(0, 2, [3, 3, 4, 4]), (1, 4, [2, 2, 3, 3])]
    consumer.append_output_token_ids(9)
    assert step(manager, consumer, 1, lookup=False) == (
        0,
        ([9], []),
        [],
        ([1, 2, 3, 5, 6, 9], [0, 0, 8]),
    )
    manager.free(consumer)
    assert manager.block_pool.free_block_ids() == [8, *range(9, 24), 4, 7, 6, 5, 3, 2, 1]


def test_a_producer_going_on_past_its_tail_leaves_a_copy_in_the_cache():
    manager = make(30, full(4), mamba(8))
    producer = make_request("p", range(11), 2)
    assert step(manager, producer, 10) == (0, ([1, 2, 3], [0, 4]), [], ([1, 2, 3], [0, 4]))
    # Its next step overwrites block 4, whose state at 10 tokens the cache keeps: the keys
    # move to block 5, filled by the copy; the table stays on block 4.
    assert step(manager, producer, 1, lookup=False) == (0, ([], []), [(4, 5)], ([1, 2, 3], [0, 4]))
    assert stored(manager.take_events()) == [
        (0, 4, list(range(8))),
        (0, 2, [8, 9]),  # the prompt's tail inside the third full-attention block
        (1, 8, list(range(8))),
        (1, 2, [8, 9]),
    ]
    manager.free(producer)
    sibling = make_request("s", [*range(10), 70, 71, 72], 2)
    # A hit of 10 tokens ends inside a block of both groups: both are copied.
    assert step(manager, sibling, 3) == (
        10,
        ([4, 6], [7]),
        [(3, 4), (5, 7)],
        ([1, 2, 4, 6], [0, 7]),
    )
    assert stored(manager.take_events()) == [(0, 4, [8, 9, 70, 71])]
    manager.free(sibling)
    assert manager.block_pool.free_block_ids() == [7, 6, *range(8, 30), 3, 5, 4, 2, 1]


def test_a_block_under_two_keys_is_evicted_with_both():
    manager = make(9, full(2), mamba(4))
    removed = []
    for request_id, offset in (("a", 0), ("b", 100), ("c", 200)):
        request = make_request(request_id, range(offset, offset + 7), 2)
        step(manager, request, 6)
        request.append_output_token_ids(1)
        step(manager, request, 1, lookup=False)
        manager.free(request)
        removed.append([e.group_idx for e in manager.take_events() if isinstance(e, BlockRemoved)])
    assert removed == [[], [1, 0], [0, 0, 1, 0]]
    assert manager.block_pool.free_block_ids() == [1, 3, 5, 4, 7, 2, 6, 8]


def test_a_sub_block_entry_is_promoted_when_its_block_fills():
    pool = BlockPool(4, hash_block_size=2, enable_kv_cache_events=True)
    request = make_request("r", range(8), 2)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_partial_block(request, block, 2, 0, 4) == request.block_hashes[0]
    assert pool.cache_partial_block(request, block, 2, 0, 4) == request.block_hashes[0]
    assert len(pool.take_events()) == 1  # entering the same key again sends nothing
    pool.cache_full_blocks(request, [block], [request.block_hashes[1]], 0, 1, 4, 0)
    removed, full_entry = pool.take_events()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [request.block_hashes[0]]
    assert full_entry.block_hashes == [request.block_hashes[1]]
    assert (block.block_hash, block.block_hash_num_tokens) == (request.block_hashes[1], 4)
    # The tail key comes back as a further key of the full block.
    pool.cache_partial_block(request, block, 2, 0, 4)
    assert pool.get_cached_block(request.block_hashes[0], [0]) == [block]
    assert pool.num_cached_blocks() == 1
    pool.check_invariants()
    with pytest.raises(InvalidArgumentError, match="num_tokens 3 must be a positive multiple"):
        pool.cache_partial_block(request, block, 3, 0, 4)
    pool.free_blocks([block])
    pool.get_new_blocks(2)  # the unhashed free blocks first; then the cached one
    (reused,) = pool.get_new_blocks(1)
    assert reused is block and block.block_hash is None
    assert pool.get_cached_block(request.block_hashes[0], [0]) is None
    pool.check_invariants()


def test_copies_are_vllms_named_tuple():
    assert KVCacheBlockCopy(3, 4) == (3, 4)
    assert KVCacheBlockCopy(3, 4)._fields == ("src_block_id", "dst_block_id")
