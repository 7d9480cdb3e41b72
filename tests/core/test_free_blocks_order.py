"""`BlockPool.free_blocks` (one fused pass) against the rule it implements, on random inputs.

The rule: drop one reference per listed block (the null block skipped); of the blocks that
reach zero, unhashed ones go to the head in the order given, hashed ones to the tail in the
order given. A block listed while already free (a double free) raises and changes nothing.
"""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import InvalidArgumentError
from pagedkv.block_pool import BlockPool

NUM_BLOCKS = 24


def state(pool: BlockPool) -> tuple:
    return pool.free_block_ids(), [block.ref_cnt for block in pool.blocks]


def expected_after_free(pool: BlockPool, ordered: list) -> tuple:
    """The rule, computed on plain data from the pool's current state."""
    free, ref_cnts = state(pool)
    ref_cnts = list(ref_cnts)
    to_head, to_tail = [], []
    for block in ordered:
        if block is pool.null_block:
            continue
        ref_cnts[block.block_id] -= 1
        if ref_cnts[block.block_id] == 0:
            (to_head if block.block_hash is None else to_tail).append(block.block_id)
    return to_head + free + to_tail, ref_cnts


def pool_with_held_blocks(seed: int) -> tuple[BlockPool, list]:
    """A pool whose queue already has hashed and unhashed blocks, and held blocks, some shared."""
    rng = random.Random(seed)
    pool = BlockPool(NUM_BLOCKS, hash_block_size=4)
    held = pool.get_new_blocks(NUM_BLOCKS - 1)
    for block in held:
        if rng.random() < 0.5:
            block_hash = block.block_id.to_bytes(32, "big")
            block.block_hash = block_hash
            pool.hash_to_block[0][block_hash] = block
    rng.shuffle(held)
    pool.free_blocks(held[:6])  # a mixed free queue to append and prepend to
    held = held[6:]
    pool.touch(held[:5])  # shared: ref_cnt 2
    return pool, held


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), data=st.data())
def test_free_blocks_follows_the_rule(seed, data):
    pool, held = pool_with_held_blocks(seed)
    # Any order, shared blocks listed up to their reference count, nulls anywhere.
    pool_of_refs = [block for block in held for _ in range(block.ref_cnt)] + [pool.null_block] * 3
    ordered = data.draw(st.permutations(pool_of_refs))
    ordered = ordered[: data.draw(st.integers(0, len(ordered)))]
    expected = expected_after_free(pool, ordered)
    pool.free_blocks(ordered)
    assert state(pool) == expected
    pool.check_invariants()


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 10**6), data=st.data())
def test_a_double_free_anywhere_changes_nothing(seed, data):
    pool, held = pool_with_held_blocks(seed)
    pool_of_refs = [block for block in held for _ in range(block.ref_cnt)] + [pool.null_block]
    ordered = data.draw(st.permutations(pool_of_refs))
    # One reference too many: a free block, or a held block listed once more than it is held.
    extra = data.draw(st.sampled_from([*held, pool.free_block_queue.get_all_free_blocks()[0]]))
    ordered.insert(data.draw(st.integers(0, len(ordered))), extra)
    before = state(pool)
    links = [(b.prev_free_block, b.next_free_block) for b in pool.blocks]
    hashes = copy.copy(pool.hash_to_block[0])
    with pytest.raises(InvalidArgumentError, match="already free"):
        pool.free_blocks(ordered)
    assert state(pool) == before
    assert [(b.prev_free_block, b.next_free_block) for b in pool.blocks] == links
    assert pool.hash_to_block[0] == hashes
    pool.check_invariants()
