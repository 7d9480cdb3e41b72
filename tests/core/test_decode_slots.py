"""allocate_decode_slots: the batched decode path equals allocate_slots(request, 1) per request."""

from __future__ import annotations

import random

import pytest

from pagedkv import InvalidArgumentError, RequestStateError, RequestStatus
from tests.support.builders import admit, make_manager, make_request, snapshot


def comparable(manager) -> dict:
    state = snapshot(manager)
    state["requests"] = sorted(state["requests"])
    return state


def build(seed: int, **kwargs):
    """A manager with running requests of assorted lengths (some sharing a prefix)."""
    rng = random.Random(seed)
    manager = make_manager(14, 4, max_model_len=64, **kwargs)
    requests = []
    for index in range(5):
        prefix = [7] * 8 if index % 2 else []
        tokens = prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
        req = make_request(f"r{index}", tokens, 4)
        new_ids, _ = admit(manager, req)
        assert new_ids is not None
        req.status = RequestStatus.RUNNING
        requests.append(req)
    return manager, requests


def one_by_one(manager, requests, start=0):
    with_new_blocks = []
    for index in range(start, len(requests)):
        new_blocks = manager.allocate_slots(requests[index], 1)
        if new_blocks is None:
            return index - start, with_new_blocks
        if new_blocks.blocks[0]:
            with_new_blocks.append(requests[index])
    return len(requests) - start, with_new_blocks


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("events", [False, True])
def test_batched_decode_equals_per_request_allocation(seed, events):
    batched, batched_reqs = build(seed, enable_kv_cache_events=events)
    single, single_reqs = build(seed, enable_kv_cache_events=events)
    assert comparable(batched) == comparable(single)
    rng = random.Random(1000 + seed)
    for _ in range(40):
        if not batched_reqs:
            break
        token = rng.randrange(50)
        for a, b in zip(batched_reqs, single_reqs, strict=True):
            a.append_output_token_ids(token)
            b.append_output_token_ids(token)
        num_allocated, with_new = batched.allocate_decode_slots(batched_reqs)
        expected_allocated, expected_new = one_by_one(single, single_reqs)
        assert num_allocated == expected_allocated
        assert [r.request_id for r in with_new] == [r.request_id for r in expected_new]
        assert comparable(batched) == comparable(single)
        batched.check_invariants()
        for reqs, manager in ((batched_reqs, batched), (single_reqs, single)):
            for req in reqs[:num_allocated]:
                req.num_computed_tokens += 1
            # The scheduler preempts the request that did not fit (and stops the batch there).
            for req in reqs[num_allocated:]:
                manager.free(req)
                req.status = RequestStatus.PREEMPTED
                req.num_computed_tokens = 0
            del reqs[num_allocated:]
            for req in list(reqs):
                if req.num_tokens >= 60:
                    manager.free(req)
                    reqs.remove(req)
    assert comparable(batched) == comparable(single)


def test_decode_batch_exact_blocks():
    manager = make_manager(6, 4)
    a = make_request("a", [1, 2, 3, 4], 4)
    b = make_request("b", [5, 6, 7], 4)
    assert admit(manager, a) == ([1], 0)
    assert admit(manager, b) == ([2], 0)
    for req in (a, b):
        req.status = RequestStatus.RUNNING
        req.append_output_token_ids(9)
    # a needs a new block for its 5th token; b's 4th token still fits in block 2.
    num_allocated, with_new = manager.allocate_decode_slots([a, b])
    assert num_allocated == 2 and with_new == [a]
    assert manager.get_block_ids("a") == ([1, 3],)
    assert manager.get_block_ids("b") == ([2],)
    # b's block 2 is now full (4 tokens) and cached; a's block 3 holds 1 token.
    assert manager.block_pool.blocks[2].block_hash == b.block_hashes[0]
    assert manager.block_pool.blocks[3].block_hash is None


def test_decode_batch_stops_at_first_request_that_does_not_fit():
    manager = make_manager(4, 4)  # 3 usable blocks
    a = make_request("a", [1, 2, 3, 4], 4)
    b = make_request("b", [5, 6, 7, 8], 4)
    c = make_request("c", [9], 4)
    for req in (a, b, c):
        admit(manager, req)
        req.status = RequestStatus.RUNNING
        req.append_output_token_ids(0)
    assert manager.block_pool.get_num_free_blocks() == 0
    before = snapshot(manager)
    num_allocated, with_new = manager.allocate_decode_slots([c, a, b])
    # c fits in its block; a needs a block and there is none: a and b get nothing.
    assert num_allocated == 1 and with_new == []
    assert snapshot(manager)["tables"] == before["tables"]
    manager.free(a)
    num_allocated, with_new = manager.allocate_decode_slots([c, a, b], start=2)
    assert num_allocated == 1 and with_new == [b]
    # a's freed block 1 (cached, the only free block) is reused, evicting a's cache entry.
    assert manager.get_block_ids("b") == ([2, 1],)
    assert manager.block_pool.cached_hashes(0) == {
        b.block_hashes[0]: [2]
    }  # only b has a full block


def test_decode_batch_rejects_requests_without_blocks():
    manager = make_manager(6, 4)
    a = make_request("a", [1, 2, 3], 4)
    admit(manager, a)
    a.status = RequestStatus.RUNNING
    stranger = make_request("s", [1, 2], 4)
    stranger.status = RequestStatus.RUNNING
    before = snapshot(manager)
    with pytest.raises(RequestStateError, match="'s' holds no blocks"):
        manager.allocate_decode_slots([a, stranger])
    assert snapshot(manager) == before
    with pytest.raises(InvalidArgumentError, match="start must be >= 0, got -1"):
        manager.allocate_decode_slots([a], start=-1)
    assert snapshot(manager) == before
