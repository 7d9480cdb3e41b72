"""Each eviction policy's own order, pinned with exact block ids (the order is the spec)."""

from __future__ import annotations

from pagedkv import BlockPool, Request, make_request_block_hasher
from pagedkv.eviction import NEVER, EvictionConfig
from tests.support.eviction import HashOrderOracle

BS = 4
HASHER = make_request_block_hasher(BS)


def pool_with(policy: str, num_blocks: int, **kwargs) -> BlockPool:
    return BlockPool(
        num_blocks,
        hash_block_size=BS,
        enable_kv_cache_events=True,
        eviction=EvictionConfig(policy=policy, **kwargs),
    )


def store(pool: BlockPool, name: str, tokens: list[int]) -> tuple[Request, list[int]]:
    """Allocate a request's blocks, cache its full blocks, free them (last first)."""
    request = Request(name, tokens, block_hasher=HASHER)
    blocks = pool.get_new_blocks(-(-len(tokens) // BS))
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, len(tokens) // BS, BS, 0)
    pool.free_blocks(reversed(blocks))
    pool.check_invariants()
    return request, [block.block_id for block in blocks]


def hit(pool: BlockPool, request: Request, times: int = 1) -> None:
    """Look the request's blocks up, touch them and free them again, `times` times."""
    for _ in range(times):
        blocks = [pool.get_cached_block(h, [0])[0] for h in request.block_hashes]  # type: ignore[index]
        pool.touch(blocks)
        pool.free_blocks(reversed(blocks))
    pool.check_invariants()


def take(pool: BlockPool, num_blocks: int) -> list[int]:
    """Allocate blocks and keep holding them; return the ids handed out."""
    blocks = pool.get_new_blocks(num_blocks)
    HELD.setdefault(id(pool), []).extend(blocks)
    pool.check_invariants()
    return [block.block_id for block in blocks]


def release(pool: BlockPool) -> None:
    """Free every block `take` handed out (they come back unhashed: reused first)."""
    pool.free_blocks(HELD.pop(id(pool), []))
    pool.check_invariants()


HELD: dict[int, list] = {}


# ---------------------------------------------------------------------------- lfu


def test_lfu_evicts_least_frequent_first_fifo_among_equals_and_ages():
    pool = pool_with("lfu", 7)
    a, a_ids = store(pool, "a", list(range(8)))  # 1 2
    hit(pool, a, times=2)  # count 3: key age+3
    _, b_ids = store(pool, "b", list(range(100, 108)))  # 3 4, count 1
    _, c_ids = store(pool, "c", list(range(200, 208)))  # 5 6, count 1
    assert (a_ids, b_ids, c_ids) == ([1, 2], [3, 4], [5, 6])
    assert pool.free_block_ids() == [4, 3, 6, 5, 2, 1]
    assert take(pool, 2) == [4, 3]  # b: key 1, freed first (its tail first)
    assert pool.eviction_policy.age == 1  # type: ignore[union-attr]
    release(pool)
    _, d_ids = store(pool, "d", list(range(300, 308)))  # reuses 4 3; key age+1 = 2
    assert d_ids == [4, 3]
    assert take(pool, 2) == [6, 5]  # c (key 1) before d (key 2)
    assert take(pool, 2) == [3, 4]  # d (key 2) before a (key 3): a's popularity has aged
    assert take(pool, 2) == [2, 1]


# ---------------------------------------------------------------------------- s3fifo


def test_s3fifo_promotes_blocks_hit_in_small_and_evicts_one_hit_wonders():
    pool = pool_with("s3fifo", 11)  # 10 usable: small target 1, ghost capacity 9
    a, a_ids = store(pool, "a", list(range(4)))  # block 1 in S
    hit(pool, a)  # hit while in S
    scans = [store(pool, f"x{i}", list(range(100 + 10 * i, 104 + 10 * i))) for i in range(9)]
    assert [ids for _, ids in scans] == [[i] for i in range(2, 11)]
    # S = [a x0 .. x8]: a was hit, so it moves to M; x0 is the first one-hit wonder to go.
    assert take(pool, 1) == [2]
    assert take(pool, 3) == [3, 4, 5]
    policy = pool.eviction_policy
    assert policy.num_main_members == 1  # type: ignore[union-attr]
    # x0 comes back: its hash is in the ghost, so it enters M directly and outlives S.
    x0, _ = scans[0]
    _, again = store(pool, "x0-again", list(x0.all_token_ids))
    assert policy.num_main_members == 2  # type: ignore[union-attr]
    order = pool.free_block_ids()
    assert order[-2:] == [1, again[0]]  # M after S, a first (freed first)


# ---------------------------------------------------------------------------- arc


def test_arc_moves_hits_to_t2_and_adapts_to_ghost_hits():
    pool = pool_with("arc", 5)  # c = 4
    a, _ = store(pool, "a", list(range(4)))  # 1, T1
    hit(pool, a)  # T2
    _, b = store(pool, "b", list(range(10, 14)))  # 2, T1
    _, c = store(pool, "c", list(range(20, 24)))  # 3, T1
    _, d = store(pool, "d", list(range(30, 34)))  # 4, T1
    policy = pool.eviction_policy
    assert (policy.num_t1_members, policy.num_t2_members) == (3, 1)  # type: ignore[union-attr]
    assert pool.free_block_ids() == [2, 3, 4, 1]  # T1 (|T1| = 3 > p = 0), then T2
    assert take(pool, 1) == [2]  # b goes to B1
    _, b_again = store(pool, "b-again", list(range(10, 14)))  # evicts c (T1), finds b in B1
    assert b_again == [3]
    assert policy.target_t1_blocks == 1.0  # type: ignore[union-attr]
    assert (policy.num_t1_members, policy.num_t2_members) == (1, 2)  # type: ignore[union-attr]
    # |T1| = 1 is not above p = 1: T2 goes first now, least recently freed (a) first.
    assert pool.free_block_ids() == [1, 3, 4]


# ---------------------------------------------------------------------------- cost


def test_cost_values_reuse_where_lru_values_recency():
    pool = pool_with("cost", 8)
    a, a_ids = store(pool, "a", list(range(12)))  # chain 1 <- 2 <- 3
    hit(pool, a, times=2)  # three accesses each: value 6
    _, b_ids = store(pool, "b", list(range(100, 104)))  # 4, freed last, one access: value 2
    assert (a_ids, b_ids) == ([1, 2, 3], [4])
    assert take(pool, 3) == [5, 6, 7]  # never-cached blocks first
    assert take(pool, 4) == [4, 3, 2, 1]  # LRU would take a's chain (older) first


def test_cost_evicts_children_before_parents_even_when_deeper_is_dearer():
    # A tiny crossover makes depth dominate: block i of a chain costs i + 2.
    pool = pool_with("cost", 8, attention_crossover_tokens=4)
    store(pool, "a", list(range(12)))  # 1 (value 4) <- 2 (6) <- 3 (8)
    store(pool, "b", list(range(100, 104)))  # 4 (value 4)
    # Keys: 3 -> 8, and its parents are raised to it (a prefix is worth its continuation).
    assert take(pool, 3 + 4) == [5, 6, 7, 4, 3, 2, 1]


def test_cost_may_evict_a_parent_whose_child_is_held():
    pool = pool_with("cost", 4)
    request = Request("r", list(range(8)), block_hasher=HASHER)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(request, blocks, request.block_hashes, 0, 2, BS, 0)
    pool.free_blocks([blocks[0]])  # the parent is free, its child still held (a window)
    pool.check_invariants()
    assert take(pool, 2) == [3, 1]  # the documented exception: the pool hands out every
    assert blocks[1].block_hash is not None  # block it counts as free


# ---------------------------------------------------------------------------- belady


def test_belady_evicts_furthest_next_use_first():
    requests = {
        name: Request(name, list(range(k, k + 4)), block_hasher=HASHER)
        for name, k in (("a", 0), ("b", 10), ("c", 20))
    }
    next_uses = {requests["a"].block_hashes[0]: 5, requests["b"].block_hashes[0]: 2}
    pool = pool_with("belady", 4, oracle=HashOrderOracle(next_uses))
    for name in "abc":
        store(pool, name, requests[name].all_token_ids)
    assert take(pool, 3) == [3, 1, 2]  # c never again, a at 5, b at 2


def test_belady_evicts_a_child_before_its_parent_and_duplicates_first():
    parent_child = Request("pc", list(range(8)), block_hasher=HASHER)
    # The fake future says the parent is never used again, the child soon: leaves go first.
    next_uses = {parent_child.block_hashes[0]: NEVER, parent_child.block_hashes[1]: 1}
    pool = pool_with("belady", 6, oracle=HashOrderOracle(next_uses))
    store(pool, "pc", parent_child.all_token_ids)  # 1 <- 2
    # A second copy of the parent's block (a duplicate, never hit while 1 is cached).
    dup = Request("dup", list(range(4)), block_hasher=HASHER)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(dup, blocks, dup.block_hashes, 0, 1, BS, 0)
    pool.free_blocks(blocks)
    assert pool.cached_hashes()[dup.block_hashes[0]] == [1, 3]
    assert take(pool, 2 + 3) == [4, 5, 3, 2, 1]
