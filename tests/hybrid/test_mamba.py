"""Mamba as vLLM 0.33 accounts it: mode "align" caches the state at each block boundary a step
ends on and holds at most two state blocks (plus speculative ones); mode "none" holds one state
block a request and is never cached. Every expected value below was produced by running the
same calls on vLLM 0.33's own KVCacheManager."""

from __future__ import annotations

import pytest

from pagedkv import ConfigError, MambaSpec
from pagedkv.managers import MambaAlignManager, MambaNoCacheManager
from tests.support.hybrid import full, make_manager, make_request


def mamba(block_size: int, mode: str = "align", num_speculative_blocks: int = 0) -> MambaSpec:
    return MambaSpec(
        block_size,
        ((4, 8),),
        2,
        mamba_cache_mode=mode,
        num_speculative_blocks=num_speculative_blocks,
    )


def hit(manager, request) -> tuple[tuple[list[int], ...], int]:
    blocks, num_tokens, _ = manager.get_computed_blocks(request)
    return blocks.get_block_ids(), num_tokens


def allocate(manager, request, num_tokens, hits=None, num_hit_tokens=0, num_lookahead=0):
    new_blocks = manager.allocate_slots(
        request, num_tokens, num_hit_tokens, hits, num_lookahead_tokens=num_lookahead
    )
    return None if new_blocks is None else new_blocks.get_block_ids()


def test_the_mode_picks_the_manager_class() -> None:
    assert type(make_manager(8, mamba(4)).coordinator.single_type_managers[0]) is MambaAlignManager
    off = make_manager(8, mamba(64, "none"), max_model_len=64, enable_caching=False)
    assert type(off.coordinator.single_type_managers[0]) is MambaNoCacheManager
    with pytest.raises(ConfigError, match="needs mamba_cache_mode='align'"):
        make_manager(8, mamba(4, "none"))


def test_align_chunked_prefill_decode_and_a_hit() -> None:
    manager = make_manager(12, mamba(4))
    a = make_request("a", range(12), 4)
    assert hit(manager, a) == (([],), 0)
    # A step's tokens get one state block, at its last position; positions before are null.
    assert allocate(manager, a, 8) == ([0, 1],)
    a.num_computed_tokens = 8
    manager.new_step_starts()
    assert allocate(manager, a, 4) == ([2],)
    assert manager.get_block_ids("a") == ([0, 1, 2],)
    a.num_computed_tokens = 12
    manager.new_step_starts()
    a.append_output_token_ids(12)
    # The previous state (block 1, cached) is freed once processed past it.
    assert allocate(manager, a, 1) == ([3],)
    assert manager.get_block_ids("a") == ([0, 0, 2, 3],)
    assert manager.block_pool.free_block_ids()[-1] == 1
    a.num_computed_tokens = 13
    a.append_output_token_ids(13)
    assert allocate(manager, a, 1) == ([],)
    assert manager.get_block_ids("a") == ([0, 0, 0, 3],)
    assert manager.block_pool.free_block_ids() == [4, 5, 6, 7, 8, 9, 10, 11, 1, 2]
    a.num_computed_tokens = 14
    # The state after 12 tokens (block 2, freed but cached) serves a 14-token prompt.
    b = make_request("b", range(14), 4)
    manager.new_step_starts()
    hits, num_hit_tokens, _ = manager.get_computed_blocks(b)
    assert (hits.get_block_ids(), num_hit_tokens) == (([0, 0, 2],), 12)
    assert allocate(manager, b, 2, hits, 12) == ([4],)
    assert manager.get_block_ids("b") == ([0, 0, 2, 4],)
    manager.check_invariants()


def test_a_state_cached_this_step_cannot_be_adopted_until_the_next() -> None:
    manager = make_manager(12, mamba(4))
    a = make_request("a", range(10), 4)
    assert allocate(manager, a, 8) == ([0, 1],)
    b = make_request("b", range(10), 4)
    hits, num_hit_tokens, _ = manager.get_computed_blocks(b)
    # The lookup finds it, but its state is written only when this step runs: no fit.
    assert (hits.get_block_ids(), num_hit_tokens) == (([0, 1],), 8)
    assert allocate(manager, b, 2, hits, 8) is None
    manager.new_step_starts()
    hits, num_hit_tokens, _ = manager.get_computed_blocks(b)
    assert allocate(manager, b, 2, hits, 8) == ([2],)
    assert manager.get_block_ids("b") == ([0, 1, 2],)
    manager.check_invariants()


def test_full_attention_plus_mamba_with_speculative_blocks() -> None:
    manager = make_manager(30, full(4), mamba(4, num_speculative_blocks=2))
    a = make_request("a", range(13), 4)
    # First allocation: the state block plus two speculative blocks.
    assert allocate(manager, a, 8) == ([1, 2], [0, 3, 4, 5])
    a.num_computed_tokens = 8
    manager.new_step_starts()
    # Lookahead slots get no Mamba block; the speculative block this step passes moves to
    # the end of the table (block 4), and one fresh block (8) is the new state.
    assert allocate(manager, a, 5, num_lookahead=2) == ([6, 7], [4, 8])
    assert manager.get_block_ids("a") == ([1, 2, 6, 7], [0, 3, 0, 5, 4, 8])
    a.num_computed_tokens = 13
    expected_new = [([], []), ([9], []), ([], [])]
    for token, expected in zip(range(100, 103), expected_new, strict=True):
        a.append_output_token_ids(token)
        assert allocate(manager, a, 1, num_lookahead=2) == expected
        a.num_computed_tokens += 1
    assert manager.get_block_ids("a") == ([1, 2, 6, 7, 9], [0, 0, 0, 5, 4, 8])
    manager.free(a)
    assert manager.block_pool.free_block_ids() == [8, 4, 9, *range(10, 30), 3, 7, 6, 2, 1, 5]
    manager.check_invariants()


def test_none_mode_holds_one_state_block_plus_speculative_blocks() -> None:
    manager = make_manager(
        8, mamba(64, "none", num_speculative_blocks=2), max_model_len=64, enable_caching=False
    )
    request = make_request("a", range(40), 64)
    assert allocate(manager, request, 40) == ([1, 2, 3],)
    request.num_computed_tokens = 40
    for token in range(20):
        request.append_output_token_ids(token)
        assert allocate(manager, request, 1) == ([],)
        request.num_computed_tokens += 1
    assert manager.get_block_ids("a") == ([1, 2, 3],)
    manager.check_invariants()


def test_sizing_counts_the_reference_state_blocks() -> None:
    page = mamba(4).page_size_bytes
    assert mamba(4, "none").max_memory_usage_bytes(1 << 20) == page
    assert mamba(4, "none", 3).max_memory_usage_bytes(1 << 20) == 4 * page
    assert mamba(4, "align").max_memory_usage_bytes(1 << 20) == 2 * page
    assert mamba(4, "align", 3).max_memory_usage_bytes(1 << 20) == 5 * page
    checkpointed = MambaSpec(
        4, ((4, 8),), 2, mamba_cache_mode="align", num_prefill_checkpoint_blocks=1
    )
    assert checkpointed.max_memory_usage_bytes(1 << 20) == 3 * page
    for bad in ({"num_prefill_checkpoint_blocks": -1}, {"prefill_checkpoint_alignment": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            MambaSpec(4, ((4, 8),), 2, mamba_cache_mode="align", **bad)


@pytest.mark.parametrize(
    ("retention", "hits"),
    [
        # Dense: every boundary state is cached.
        (None, {30: 28, 24: 20, 17: 16}),
        # 0: only the replay boundary (a resend hits its last aligned block).
        (0, {30: 28, 24: 0, 17: 0}),
        # One state per 8 tokens, plus the replay boundary.
        (8, {30: 28, 24: 16, 17: 16}),
    ],
)
def test_retention_interval_keeps_only_reachable_states(retention, hits) -> None:
    from pagedkv import KVCacheConfig, KVCacheGroupSpec, KVCacheManager

    groups = [KVCacheGroupSpec(("full",), full(4)), KVCacheGroupSpec(("mamba",), mamba(4))]
    manager = KVCacheManager(
        KVCacheConfig(60, groups, prefix_cache_retention_interval=retention), max_model_len=8192
    )
    request = make_request("a", range(30), 4)
    while request.num_computed_tokens < 30:  # one block a step: every boundary has a state
        num_new = min(4, 30 - request.num_computed_tokens)
        assert manager.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        manager.new_step_starts()
    manager.free(request)
    for num_tokens, num_hit_tokens in hits.items():
        assert hit(manager, make_request("b", range(num_tokens), 4))[1] == num_hit_tokens
    manager.check_invariants()


def test_zeroing_records_new_attention_blocks() -> None:
    """A Mamba model's new attention blocks are zeroed by the worker (vLLM 0.33 values)."""
    from pagedkv import KVCacheConfig, KVCacheGroupSpec, KVCacheManager

    groups = [KVCacheGroupSpec(("full",), full(4)), KVCacheGroupSpec(("mamba",), mamba(4))]
    manager = KVCacheManager(
        KVCacheConfig(40, groups, needs_kv_cache_zeroing=True), max_model_len=8192
    )
    a = make_request("a", range(30), 4)
    assert allocate(manager, a, 8) == ([1, 2], [0, 3])
    assert manager.take_new_block_ids() == [1, 2]  # attention only; Mamba states are not
    assert manager.take_new_block_ids() == []
    a.num_computed_tokens = 8
    assert allocate(manager, a, 12) == ([4, 5, 6], [0, 0, 7])
    assert manager.take_new_block_ids() == [4, 5, 6]
    b = make_request("b", range(30), 4)
    # An async load writes the external tokens' blocks (8-11): they are not zeroed.
    new_blocks = manager.allocate_slots(
        b, 4, num_external_computed_tokens=16, skip_zeroing_group_ids=(0,)
    )
    assert new_blocks.get_block_ids() == ([13], [14])
    assert manager.get_block_ids("b") == ([8, 9, 10, 11, 13], [0, 0, 0, 12, 14])
    assert manager.take_new_block_ids() == [13]
    manager.record_blocks_for_zeroing("a", 8)  # a failed load left them unwritten
    assert manager.take_new_block_ids() == [4, 5, 6]


def test_boundary_state_offers_only_when_asked_for_and_until_taken() -> None:
    manager = make_manager(12, mamba(4))
    state = manager.coordinator.single_type_managers[0]
    assert isinstance(state, MambaAlignManager) and not state.record_boundary_state_offloads
    a = make_request("a", range(12), 4)
    allocate(manager, a, 8)
    assert state.take_pending_boundary_state_offloads() == []  # not recorded unless asked
    state.record_boundary_state_offloads = True
    a.num_computed_tokens = 8
    manager.new_step_starts()
    allocate(manager, a, 4)  # the state after 12 tokens, in block 2
    offers = state.take_pending_boundary_state_offloads()
    assert [(r, g, b.block_id, n) for r, g, b, n in offers] == [("a", 0, 2, 12)]
    assert state.take_pending_boundary_state_offloads() == []  # drained
    # Cached between steps (vLLM's update_from_output): the offer waits for the next take.
    b = make_request("b", range(20, 28), 4)
    manager.allocate_slots(b, 8, delay_cache_blocks=True)
    manager.cache_blocks(b, 8)
    manager.new_step_starts()
    offers = state.take_pending_boundary_state_offloads()
    assert [(r, n) for r, _, _, n in offers] == [("b", 8)]
    c = make_request("c", range(40, 48), 4)
    allocate(manager, c, 8)
    assert len(state._pending_boundary_state_offloads) == 1  # noqa: SLF001 - offered...
    manager.free(c)  # ...and withdrawn with the request's blocks
    assert state.take_pending_boundary_state_offloads() == []
    manager.check_invariants()
