"""allocate_slots stages: lookahead, external tokens, the zero-token call, and the admission
gates (full_sequence_must_fit, reserved_blocks, watermark)."""

from __future__ import annotations

import pytest

from pagedkv import InvalidArgumentError, RequestStatus
from tests.support.builders import admit, free_ids, make_manager, make_request, snapshot

COMMON = [i for i in range(3) for _ in range(16)]


# ---------------------------------------------------------------------------- lookahead


@pytest.mark.parametrize(
    ("num_lookahead_tokens", "max_model_len", "expected_ids"),
    [
        (0, 100, [1]),
        (2, 100, [1, 2]),  # cdiv(3 + 2, 4) = 2
        (4, 100, [1, 2]),  # cdiv(3 + 4, 4) = 2
        (6, 100, [1, 2, 3]),  # cdiv(3 + 6, 4) = 3
        (6, 8, [1, 2]),  # min(3 + 6, max_model_len 8) -> 2 blocks
        (100, 8, [1, 2]),  # lookahead is capped, never an error
    ],
)
def test_lookahead_slots(num_lookahead_tokens, max_model_len, expected_ids):
    manager = make_manager(10, 4, max_model_len=max_model_len)
    req = make_request("r", [1, 2, 3], 4)
    new = manager.allocate_slots(req, 3, num_lookahead_tokens=num_lookahead_tokens)
    assert new.get_block_ids() == (expected_ids,)
    manager.check_invariants()


def test_lookahead_slots_are_never_cached():
    manager = make_manager(10, 4)
    req = make_request("r", list(range(8)), 4)
    assert manager.allocate_slots(req, 8, num_lookahead_tokens=4).get_block_ids() == ([1, 2, 3],)
    assert manager.block_pool.num_cached_blocks() == 2
    assert manager.block_pool.blocks[3].block_hash is None


def test_unverified_draft_tokens_are_not_cached():
    """Caching is capped at request.num_tokens: scheduled drafts beyond it stay unhashed."""
    manager = make_manager(10, 4)
    req = make_request("r", [1, 2, 3, 4], 4)
    assert admit(manager, req) == ([1], 0)
    req.append_output_token_ids(5)  # 5 real tokens; the scheduler adds 3 drafts
    assert manager.allocate_slots(req, 4).get_block_ids() == ([2],)
    assert manager.block_pool.blocks[2].block_hash is None
    assert manager.coordinator.single_type_managers[0].num_cached_block["r"] == 1
    req.num_computed_tokens = 8
    req.append_output_token_ids([6, 7, 8])  # the drafts were accepted
    assert manager.allocate_slots(req, 1).get_block_ids() == ([3],)
    assert manager.block_pool.blocks[2].block_hash == req.block_hashes[1]
    manager.check_invariants()


# ------------------------------------------------------------------ zero tokens / external


def test_zero_token_call_raises_reference_message(manager):
    req = make_request("r", COMMON)
    before = snapshot(manager)
    with pytest.raises(
        InvalidArgumentError,
        match="num_new_tokens must be greater than 0 when there are no computed tokens to adopt",
    ):
        manager.allocate_slots(req, 0)
    assert snapshot(manager) == before


def test_external_tokens_only(manager):
    req = make_request("r", COMMON + [5] * 8)
    new = manager.allocate_slots(req, 0, num_external_computed_tokens=32)
    # The blocks for connector-loaded tokens are not "new" blocks (as in vLLM 0.33): the
    # scheduler reads a new request's whole table.
    assert new is manager.empty_kv_cache_blocks
    assert manager.get_block_ids("r") == ([1, 2],)
    # Connector-loaded tokens are part of the request's prefix: they are cached too.
    assert manager.block_pool.cached_hashes(0) == {
        req.block_hashes[0]: [1],
        req.block_hashes[1]: [2],
    }
    manager.check_invariants()


def test_local_hit_plus_external_plus_new(manager):
    r0 = make_request("0", COMMON[:32] + [7])
    assert admit(manager, r0) == ([1, 2, 3], 0)
    r1 = make_request("1", COMMON + [9] * 20)  # 68 tokens
    hits, num_hit_tokens, _ = manager.get_computed_blocks(r1)
    assert hits.get_block_ids() == ([1, 2],) and num_hit_tokens == 32
    new = manager.allocate_slots(
        r1, 20, 32, hits, num_external_computed_tokens=16, delay_cache_blocks=True
    )
    # | computed 0 | hit 32 | external 16 | new 20 | = 68 tokens -> 5 blocks: block 4 for the
    # external tokens (phase two of admission), 5 and 6 new (the only ones returned).
    assert new.get_block_ids() == ([5, 6],)
    assert manager.get_block_ids("1") == ([1, 2, 4, 5, 6],)
    assert manager.block_pool.blocks[4].block_hash is None  # delayed
    manager.cache_blocks(r1, 48)
    assert manager.block_pool.blocks[4].block_hash == r1.block_hashes[2]
    manager.check_invariants()


# ------------------------------------------------------------------ full_sequence_must_fit


def hold(manager, request_id: str, num_blocks: int, block_size: int = 16):
    """Admit a filler request holding `num_blocks` unique blocks."""
    req = make_request(request_id, [1000 + sum(map(ord, request_id))] * (num_blocks * block_size))
    ids, _ = admit(manager, req)
    assert len(ids) == num_blocks
    return req


def test_full_sequence_must_fit_gate(manager):
    hold(manager, "filler", 4)  # 6 free
    req = make_request("r", list(range(100)))  # 7 blocks in all
    before = snapshot(manager)
    assert manager.allocate_slots(req, 16, full_sequence_must_fit=True) is None
    assert snapshot(manager) == before
    # Without the gate the first chunk fits.
    assert manager.allocate_slots(req, 16).get_block_ids() == ([5],)
    manager.free(req)
    assert free_ids(manager) == [6, 7, 8, 9, 10, 5]  # block 5 was full: cached, to the tail
    req2 = make_request("r2", list(range(200, 296)))  # 6 blocks: fits exactly
    assert manager.allocate_slots(req2, 16, full_sequence_must_fit=True).get_block_ids() == ([6],)
    manager.check_invariants()


def test_full_sequence_must_fit_caps_at_max_model_len():
    manager = make_manager(11, 16, max_model_len=64)
    for name in ("f1", "f2", "f3"):
        hold(manager, name, 2)  # 4 free in the end
    req = make_request("r", list(range(100)))  # 7 blocks, but at most 64 tokens = 4 blocks
    assert manager.allocate_slots(req, 16, full_sequence_must_fit=True).get_block_ids() == ([7],)


def test_full_sequence_must_fit_counts_evictable_hits(manager):
    r0 = make_request("0", COMMON)
    admit(manager, r0)
    manager.free(r0)  # 1, 2, 3 free but cached
    hold(manager, "filler", 3)  # takes 4, 5, 6: 7 free (3 of them r0's cached blocks)
    req = make_request("r", COMMON + list(range(52)))  # 100 tokens, 7 blocks; hits 3
    hits, num_hit_tokens, _ = manager.get_computed_blocks(req)
    assert num_hit_tokens == 48
    # 4 new blocks + 3 evictable hits = 7 <= 7 free.
    new = manager.allocate_slots(req, 16, 48, hits, full_sequence_must_fit=True)
    assert new.get_block_ids() == ([7],)
    manager.free(req)
    hold(manager, "filler2", 1)  # now 6 free
    req2 = make_request("r2", COMMON + list(range(52)))
    hits, num_hit_tokens, _ = manager.get_computed_blocks(req2)
    assert num_hit_tokens == 64  # req cached its first chunk (block 4) too
    before = snapshot(manager)
    # 3 new blocks + 4 evictable hits = 7 > 6 free.
    assert manager.allocate_slots(req2, 16, 64, hits, full_sequence_must_fit=True) is None
    assert snapshot(manager) == before


def test_full_sequence_must_fit_ignores_reserved_blocks(manager):
    hold(manager, "filler", 2)  # 8 free
    req = make_request("r", list(range(100)))  # needs 7 in all, 1 now
    assert manager.allocate_slots(
        req, 16, full_sequence_must_fit=True, reserved_blocks=7
    ).get_block_ids() == ([3],)
    manager.free(req)
    assert manager.allocate_slots(req, 16, full_sequence_must_fit=True, reserved_blocks=8) is None


# ---------------------------------------------------------------------------- reserved_blocks


def test_reserved_blocks_gate(manager):
    req = make_request("r", list(range(60)))  # 4 blocks; 10 free
    before = snapshot(manager)
    assert manager.allocate_slots(req, 60, reserved_blocks=7) is None
    assert snapshot(manager) == before
    assert manager.allocate_slots(req, 60, reserved_blocks=6).get_block_ids() == ([1, 2, 3, 4],)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10]


# ---------------------------------------------------------------------------- watermark


def watermark_manager():
    manager = make_manager(11, 16, watermark=0.2)
    assert manager.watermark_blocks == 2  # int(0.2 * 11)
    hold(manager, "filler", 5)  # 5 free
    return manager


def test_watermark_blocks_new_admissions():
    manager = watermark_manager()
    req = make_request("r", list(range(64)))  # 4 blocks: 4 + 2 > 5
    before = snapshot(manager)
    assert manager.allocate_slots(req, 64) is None
    assert snapshot(manager) == before
    small = make_request("s", list(range(48)))  # 3 blocks: 3 + 2 <= 5
    assert manager.allocate_slots(small, 48).get_block_ids() == ([6, 7, 8],)


def test_watermark_not_applied_to_first_admission():
    manager = watermark_manager()
    req = make_request("r", list(range(64)))
    assert manager.allocate_slots(req, 64, has_scheduled_reqs=False).get_block_ids() == (
        [6, 7, 8, 9],
    )


def test_watermark_not_applied_to_running_requests():
    manager = watermark_manager()
    req = make_request("r", list(range(64)))
    req.status = RequestStatus.RUNNING
    assert manager.allocate_slots(req, 64).get_block_ids() == ([6, 7, 8, 9],)


def test_watermark_applies_to_preempted_requests():
    manager = watermark_manager()
    req = make_request("r", list(range(64)))
    req.status = RequestStatus.PREEMPTED
    req.num_preemptions = 1
    assert manager.allocate_slots(req, 64) is None


def test_watermark_in_full_sequence_gate():
    manager = watermark_manager()
    req = make_request("r", list(range(64)))  # 4 blocks + 2 watermark > 5
    assert manager.allocate_slots(req, 16, full_sequence_must_fit=True) is None
    assert manager.allocate_slots(req, 16).get_block_ids() == ([6],)
