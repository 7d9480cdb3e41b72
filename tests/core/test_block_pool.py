"""BlockPool: null block, allocation, touch/free order, caching, duplicates, eviction, reset."""

from __future__ import annotations

import pytest

from pagedkv import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    ConfigError,
    InvalidArgumentError,
    InvariantViolation,
    Request,
    make_request_block_hasher,
)

BLOCK_SIZE = 4
HASHER = make_request_block_hasher(BLOCK_SIZE)


def request(request_id: str, token_ids: list[int], **kwargs) -> Request:
    return Request(request_id, token_ids, block_hasher=HASHER, **kwargs)


def pool_of(num_blocks: int = 8, **kwargs) -> BlockPool:
    kwargs.setdefault("hash_block_size", BLOCK_SIZE)
    return BlockPool(num_blocks, **kwargs)


def cache(pool: BlockPool, req: Request, blocks, num_cached: int = 0, group_id: int = 0) -> None:
    """Cache every full block of `req` held in `blocks`."""
    num_full = min(len(blocks), req.num_tokens // BLOCK_SIZE)
    pool.cache_full_blocks(
        req, blocks, req.block_hashes, num_cached, num_full, BLOCK_SIZE, group_id
    )


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------------------- construction


def test_construction_null_block_and_initial_state():
    pool = pool_of(6)
    assert pool.null_block is pool.blocks[0]
    assert pool.null_block.is_null and not pool.blocks[1].is_null
    assert [b.block_id for b in pool.blocks] == [0, 1, 2, 3, 4, 5]
    assert pool.free_block_ids() == [1, 2, 3, 4, 5]
    assert pool.get_num_free_blocks() == 5
    assert pool.get_usage() == 0.0
    assert pool.num_cached_blocks() == 0
    assert pool.null_block.prev_free_block is None and pool.null_block.next_free_block is None
    pool.check_invariants()


def test_two_block_pool_is_the_minimum():
    pool = pool_of(2)
    assert pool.free_block_ids() == [1]
    assert ids(pool.get_new_blocks(1)) == [1]
    assert pool.get_usage() == 1.0
    pool.check_invariants()


@pytest.mark.parametrize("num_blocks", [1, 0, -3])
def test_too_few_blocks_rejected(num_blocks):
    with pytest.raises(ConfigError, match=f"num_blocks={num_blocks}"):
        BlockPool(num_blocks, hash_block_size=BLOCK_SIZE)


# ---------------------------------------------------------------------------- allocation


def test_get_new_blocks_pops_head_in_order_with_ref_one():
    pool = pool_of(8)
    first = pool.get_new_blocks(3)
    assert ids(first) == [1, 2, 3]
    assert [b.ref_cnt for b in first] == [1, 1, 1]
    assert ids(pool.get_new_blocks(2)) == [4, 5]
    assert pool.free_block_ids() == [6, 7]
    assert pool.get_new_blocks(0) == []
    assert pool.get_usage() == pytest.approx(5 / 7)
    pool.check_invariants()


def test_get_new_blocks_too_many_raises_and_changes_nothing():
    pool = pool_of(4)
    pool.get_new_blocks(1)
    with pytest.raises(InvalidArgumentError, match="cannot allocate 3 blocks: only 2"):
        pool.get_new_blocks(3)
    assert pool.free_block_ids() == [2, 3]
    assert [b.ref_cnt for b in pool.blocks] == [0, 1, 0, 0]
    pool.check_invariants()


def test_get_new_blocks_negative_raises_and_changes_nothing():
    pool = pool_of(4)
    with pytest.raises(InvalidArgumentError, match="-1"):
        pool.get_new_blocks(-1)
    assert pool.free_block_ids() == [1, 2, 3]
    assert pool.get_num_free_blocks() == 3
    pool.check_invariants()


# ---------------------------------------------------------------------------- touch / free


def test_touch_takes_free_blocks_out_of_the_queue_and_counts_refs():
    pool = pool_of(6)
    held = pool.get_new_blocks(2)  # 1, 2
    pool.touch([held[0], pool.blocks[4], pool.null_block])
    assert held[0].ref_cnt == 2
    assert pool.blocks[4].ref_cnt == 1
    assert pool.null_block.ref_cnt == 0  # the null block is never counted
    assert pool.free_block_ids() == [3, 5]
    pool.check_invariants()


def test_free_blocks_unhashed_to_front_in_given_order():
    pool = pool_of(8)
    blocks = pool.get_new_blocks(4)  # 1 2 3 4; free: 5 6 7
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [4, 3, 2, 1, 5, 6, 7]
    assert [b.ref_cnt for b in blocks] == [0, 0, 0, 0]
    pool.check_invariants()


def test_free_blocks_hashed_to_back_unhashed_to_front_exact_order():
    pool = pool_of(8)
    req = request("a", list(range(10)))  # 2 full blocks + 2 tokens
    blocks = pool.get_new_blocks(3)  # 1 2 3
    cache(pool, req, blocks)
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    pool.free_blocks(reversed(blocks))
    # 3 (unhashed) to the head; 2 then 1 (hashed) to the tail, in the order given.
    assert pool.free_block_ids() == [3, 4, 5, 6, 7, 2, 1]
    pool.check_invariants()


def test_free_blocks_keeps_shared_blocks_and_skips_null():
    pool = pool_of(6)
    blocks = pool.get_new_blocks(2)
    pool.touch([blocks[0]])
    pool.free_blocks([pool.null_block, blocks[0], blocks[1]])
    assert blocks[0].ref_cnt == 1
    assert pool.free_block_ids() == [2, 3, 4, 5]
    assert pool.null_block.ref_cnt == 0
    pool.check_invariants()


def test_free_order_across_two_calls():
    pool = pool_of(10)
    a = pool.get_new_blocks(2)  # 1 2
    b = pool.get_new_blocks(2)  # 3 4
    pool.free_blocks(reversed(a))  # head: 2 1
    pool.free_blocks(reversed(b))  # head: 4 3 2 1
    assert pool.free_block_ids() == [4, 3, 2, 1, 5, 6, 7, 8, 9]
    assert ids(pool.get_new_blocks(3)) == [4, 3, 2]


# ---------------------------------------------------------------------------- caching


def test_cache_full_blocks_sets_hashes_and_maps():
    pool = pool_of(8)
    req = request("a", list(range(12)))
    blocks = pool.get_new_blocks(3)
    cache(pool, req, blocks)
    for block, block_hash in zip(blocks, req.block_hashes, strict=True):
        assert block.block_hash == block_hash
        assert block.hash_group_id == 0
        assert pool.hash_to_block[0][block_hash] is block
    assert pool.cached_hashes(0) == {
        h: [b.block_id] for h, b in zip(req.block_hashes, blocks, strict=True)
    }
    assert pool.num_cached_blocks() == 3
    assert pool.get_cached_block(req.block_hashes[1], [0]) == [blocks[1]]
    assert pool.get_cached_block(b"\x00" * 32, [0]) is None
    pool.check_invariants()


def test_cache_full_blocks_range_and_null_skip():
    pool = pool_of(8)
    req = request("a", list(range(12)))
    blocks = pool.get_new_blocks(2)
    table = [pool.null_block, *blocks]
    pool.cache_full_blocks(req, table, req.block_hashes, 0, 3, BLOCK_SIZE, 0)
    assert pool.null_block.block_hash is None
    assert blocks[0].block_hash == req.block_hashes[1]
    assert blocks[1].block_hash == req.block_hashes[2]
    assert pool.num_cached_blocks() == 2
    # An empty range is a no-op.
    pool.cache_full_blocks(req, table, req.block_hashes, 3, 3, BLOCK_SIZE, 0)
    assert pool.num_cached_blocks() == 2
    pool.check_invariants()


def test_cache_full_blocks_needs_enough_hashes():
    pool = pool_of(8)
    req = request("a", list(range(6)))  # one hash
    blocks = pool.get_new_blocks(2)
    with pytest.raises(InvariantViolation, match="1 block hashes, 2 needed"):
        pool.cache_full_blocks(req, blocks, req.block_hashes, 0, 2, BLOCK_SIZE, 0)
    assert pool.num_cached_blocks() == 0


def test_get_cached_block_needs_every_group():
    pool = pool_of(8, num_kv_cache_groups=2)
    req = request("a", list(range(4)))
    g0 = pool.get_new_blocks(1)
    g1 = pool.get_new_blocks(1)
    cache(pool, req, g0, group_id=0)
    assert pool.get_cached_block(req.block_hashes[0], [0]) == g0
    assert pool.get_cached_block(req.block_hashes[0], [0, 1]) is None
    assert pool.get_cached_block(req.block_hashes[0], [1]) is None
    cache(pool, req, g1, group_id=1)
    assert pool.get_cached_block(req.block_hashes[0], [1, 0]) == [g1[0], g0[0]]
    assert g1[0].hash_group_id == 1
    assert pool.cached_hashes(1) == {req.block_hashes[0]: [g1[0].block_id]}
    pool.check_invariants()


# ---------------------------------------------------------------------------- duplicates


def test_duplicates_first_cached_wins_and_promotion_when_evicted():
    pool = pool_of(8)
    tokens = list(range(4))
    r1, r2, r3 = request("1", tokens), request("2", tokens), request("3", tokens)
    (b1,) = pool.get_new_blocks(1)
    (b2,) = pool.get_new_blocks(1)
    (b3,) = pool.get_new_blocks(1)
    cache(pool, r1, [b1])
    cache(pool, r2, [b2])
    cache(pool, r3, [b3])
    block_hash = r1.block_hashes[0]
    assert pool.cached_hashes(0) == {block_hash: [1, 2, 3]}
    assert pool.num_cached_blocks() == 3
    assert pool.get_cached_block(block_hash, [0]) == [b1]
    pool.check_invariants()
    # Evicting the first promotes the earliest remaining duplicate.
    pool.evict_blocks([1])
    assert b1.block_hash is None
    assert pool.cached_hashes(0) == {block_hash: [2, 3]}
    assert pool.get_cached_block(block_hash, [0]) == [b2]
    pool.check_invariants()
    # Evicting a non-first duplicate leaves the first in place.
    pool.evict_blocks([3])
    assert pool.cached_hashes(0) == {block_hash: [2]}
    assert pool.get_cached_block(block_hash, [0]) == [b2]
    pool.check_invariants()
    pool.evict_blocks([2])
    assert pool.cached_hashes(0) == {}
    assert pool.get_cached_block(block_hash, [0]) is None
    assert pool.num_cached_blocks() == 0
    pool.check_invariants()


def test_duplicate_promotion_on_reuse():
    pool = pool_of(4)
    tokens = list(range(4))
    r1, r2 = request("1", tokens), request("2", tokens)
    (b1,) = pool.get_new_blocks(1)
    (b2,) = pool.get_new_blocks(1)
    cache(pool, r1, [b1])
    cache(pool, r2, [b2])
    pool.free_blocks([b1])  # b1 to the tail (hashed); free: 3 1
    assert pool.free_block_ids() == [3, 1]
    assert ids(pool.get_new_blocks(2)) == [3, 1]  # reusing 1 evicts it
    assert b1.block_hash is None
    assert pool.get_cached_block(r1.block_hashes[0], [0]) == [b2]
    assert pool.cached_hashes(0) == {r1.block_hashes[0]: [2]}
    pool.check_invariants()


# ---------------------------------------------------------------------------- lazy eviction


def test_lazy_eviction_keeps_hash_until_reuse():
    pool = pool_of(5, enable_kv_cache_events=True)
    req = request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)  # 1 2
    cache(pool, req, blocks)
    pool.take_events()
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 4, 2, 1]
    # Free but still cached: a lookup finds it.
    assert pool.get_cached_block(req.block_hashes[0], [0]) == [blocks[0]]
    assert pool.num_cached_blocks() == 2
    assert pool.take_events() == []
    # Reusing 3, 4 and then 2 evicts only block 2.
    assert ids(pool.get_new_blocks(3)) == [3, 4, 2]
    assert blocks[1].block_hash is None and blocks[1].ref_cnt == 1
    assert blocks[0].block_hash == req.block_hashes[0]
    assert pool.cached_hashes(0) == {req.block_hashes[0]: [1]}
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[req.block_hashes[1]], medium="GPU", group_idx=0)
    ]
    pool.check_invariants()


def test_touch_revives_a_cached_free_block():
    pool = pool_of(5)
    req = request("a", list(range(4)))
    (block,) = pool.get_new_blocks(1)
    cache(pool, req, [block])
    pool.free_blocks([block])
    assert pool.free_block_ids() == [2, 3, 4, 1]
    pool.touch([block])
    assert block.ref_cnt == 1 and block.block_hash == req.block_hashes[0]
    assert pool.free_block_ids() == [2, 3, 4]
    pool.check_invariants()


# ---------------------------------------------------------------------------- evict_blocks


def test_evict_blocks_drops_entries_but_not_refs_or_queue_position():
    pool = pool_of(6, enable_kv_cache_events=True)
    req = request("a", list(range(12)))
    blocks = pool.get_new_blocks(3)  # 1 2 3
    cache(pool, req, blocks)
    pool.free_blocks([blocks[2]])  # 3 free (hashed) at the tail
    pool.take_events()
    queue_before = pool.free_block_ids()
    pool.evict_blocks({1, 3, 4, 0})  # 4 is unhashed, 0 is null: no-ops
    assert blocks[0].block_hash is None and blocks[2].block_hash is None
    assert blocks[1].block_hash == req.block_hashes[1]
    assert [b.ref_cnt for b in blocks] == [1, 1, 0]
    assert pool.free_block_ids() == queue_before == [4, 5, 3]
    events = pool.take_events()
    assert sorted(e.block_hashes[0] for e in events) == sorted(
        [req.block_hashes[0], req.block_hashes[2]]
    )
    assert all(type(e) is BlockRemoved and e.group_idx == 0 and e.medium == "GPU" for e in events)
    pool.check_invariants()


@pytest.mark.parametrize("bad_id", [6, -1, 100, "1", 1.0])
def test_evict_blocks_bad_id_raises_and_changes_nothing(bad_id):
    pool = pool_of(6)
    req = request("a", list(range(4)))
    (block,) = pool.get_new_blocks(1)
    cache(pool, req, [block])
    with pytest.raises(InvalidArgumentError, match=repr(bad_id).replace(".", r"\.")):
        pool.evict_blocks([1, bad_id])
    # Validation happens before any eviction: block 1 keeps its hash.
    assert block.block_hash == req.block_hashes[0]
    pool.check_invariants()


# ---------------------------------------------------------------------------- reset


def test_reset_prefix_cache_refused_while_held():
    pool = pool_of(5, enable_kv_cache_events=True)
    req = request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    cache(pool, req, blocks)
    pool.take_events()
    pool.free_blocks([blocks[1]])
    assert pool.reset_prefix_cache() is False
    assert pool.num_cached_blocks() == 2
    assert blocks[1].block_hash == req.block_hashes[1]
    assert pool.take_events() == []
    pool.free_blocks([blocks[0]])
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks() == 0
    assert all(b.block_hash is None for b in pool.blocks)
    assert pool.hash_to_block == [{}]
    assert pool.take_events() == [AllBlocksCleared()]
    # Free order is untouched by a reset.
    assert pool.free_block_ids() == [3, 4, 2, 1]
    pool.check_invariants()


# ---------------------------------------------------------------------------- events


def test_block_stored_event_fields():
    pool = pool_of(8, enable_kv_cache_events=True)
    req = request("a", list(range(100, 114)), session_id="s1")  # 3 full blocks + 2
    blocks = pool.get_new_blocks(4)
    pool.cache_full_blocks(req, blocks, req.block_hashes, 0, 1, BLOCK_SIZE, 0)
    pool.cache_full_blocks(req, blocks, req.block_hashes, 1, 3, BLOCK_SIZE, 0)
    events = pool.take_events()
    assert events == [
        BlockStored(
            block_hashes=[req.block_hashes[0]],
            parent_block_hash=None,
            token_ids=[100, 101, 102, 103],
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None],  # one entry per block, as vLLM 0.33
            group_idx=0,
            session_id="s1",
        ),
        BlockStored(
            block_hashes=[req.block_hashes[1], req.block_hashes[2]],
            parent_block_hash=req.block_hashes[0],
            token_ids=list(range(104, 112)),
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
            group_idx=0,
            session_id="s1",
        ),
    ]
    assert events[0].kv_cache_spec_kind is None  # only the facade annotates
    assert pool.take_events() == []


def test_block_stored_parent_is_logical_across_a_null_block():
    pool = pool_of(8, enable_kv_cache_events=True)
    req = request("a", list(range(12)))
    (block,) = pool.get_new_blocks(1)
    table = [pool.null_block, pool.null_block, block]
    pool.cache_full_blocks(req, table, req.block_hashes, 2, 3, BLOCK_SIZE, 0)
    (event,) = pool.take_events()
    assert event.parent_block_hash == req.block_hashes[1]
    assert event.block_hashes == [req.block_hashes[2]]
    assert event.token_ids == list(range(8, 12))


def test_block_stored_skips_null_in_hashes_but_keeps_tokens():
    pool = pool_of(8, enable_kv_cache_events=True)
    req = request("a", list(range(12)))
    blocks = pool.get_new_blocks(2)
    table = [pool.null_block, *blocks]
    pool.cache_full_blocks(req, table, req.block_hashes, 0, 3, BLOCK_SIZE, 0)
    (event,) = pool.take_events()
    assert event.parent_block_hash is None
    assert event.block_hashes == [req.block_hashes[1], req.block_hashes[2]]
    assert event.token_ids == list(range(12))


def test_events_disabled_queue_stays_empty():
    pool = pool_of(5)
    req = request("a", list(range(8)))
    blocks = pool.get_new_blocks(2)
    cache(pool, req, blocks)
    pool.evict_blocks([1])
    pool.free_blocks(blocks)
    pool.reset_prefix_cache()
    assert pool.kv_event_queue == []
    assert pool.take_events() == []


def test_caching_disabled_pool_frees_to_front():
    pool = pool_of(6, enable_caching=False)
    blocks = pool.get_new_blocks(3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_ids() == [3, 2, 1, 4, 5]
    pool.check_invariants()


# ---------------------------------------------------------------------------- metrics hooks


class RecordingCollector:
    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def on_block_allocated(self, block) -> None:
        self.calls.append(("allocated", block.block_id))

    def on_block_accessed(self, block) -> None:
        self.calls.append(("accessed", block.block_id))

    def on_block_evicted(self, block) -> None:
        self.calls.append(("evicted", block.block_id))

    def reset(self) -> None:
        self.calls.append(("reset", -1))


def test_metrics_collector_hooks():
    collector = RecordingCollector()
    pool = pool_of(3, metrics_collector=collector)
    req = request("a", list(range(4)))
    (b1,) = pool.get_new_blocks(1)
    cache(pool, req, [b1])
    pool.touch([b1, pool.null_block])
    pool.free_blocks([b1, b1])
    pool.get_new_blocks(2)  # 2 then 1 (cached: evicted on reuse)
    assert collector.calls == [
        ("allocated", 1),
        ("accessed", 1),
        ("evicted", 1),
        ("allocated", 2),
        ("allocated", 1),
    ]
    pool.free_blocks(pool.blocks[1:])
    assert pool.reset_prefix_cache() is True
    assert collector.calls[-1] == ("reset", -1)


# ---------------------------------------------------------------------------- check_invariants


def corrupted_pools():
    """(description, mutate) pairs; each mutation breaks exactly one pool invariant."""

    def held_block_in_queue(pool, blocks, req):
        blocks[0].ref_cnt = 1
        pool.free_block_queue.remove(blocks[0])
        blocks[0].ref_cnt = 0  # free but unlinked

    def ref_without_owner_link(pool, blocks, req):
        pool.blocks[5].ref_cnt = 1  # still linked in the free queue

    def hash_without_map_entry(pool, blocks, req):
        blocks[2].block_hash = req.block_hashes[0]

    def map_entry_with_other_hash(pool, blocks, req):
        blocks[0].block_hash = req.block_hashes[1]

    def null_block_hashed(pool, blocks, req):
        pool.null_block.block_hash = req.block_hashes[0]

    def negative_ref(pool, blocks, req):
        blocks[2].ref_cnt = -1

    def counter_drift(pool, blocks, req):
        pool.free_block_queue.num_free_blocks += 1

    def null_block_in_queue(pool, blocks, req):
        pool.free_block_queue.append(pool.null_block)

    def wrong_block_id(pool, blocks, req):
        pool.blocks[5].block_id = 6

    return [
        held_block_in_queue,
        ref_without_owner_link,
        hash_without_map_entry,
        map_entry_with_other_hash,
        null_block_hashed,
        negative_ref,
        counter_drift,
        null_block_in_queue,
        wrong_block_id,
    ]


@pytest.mark.parametrize("mutate", corrupted_pools(), ids=lambda f: f.__name__)
def test_check_invariants_catches_corruption(mutate):
    pool = pool_of(8)
    req = request("a", list(range(8)))
    blocks = pool.get_new_blocks(3)  # 1 2 3
    cache(pool, req, blocks)  # 1 and 2 hashed
    pool.free_blocks([blocks[0]])  # 1 free (hashed)
    pool.check_invariants()  # healthy before the corruption
    mutate(pool, blocks, req)
    with pytest.raises(InvariantViolation):
        pool.check_invariants()
