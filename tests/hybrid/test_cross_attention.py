"""Cross-attention: sized by the encoder's token count, allocated once, never prefix-cached."""

from __future__ import annotations

import pytest

from pagedkv import BlockPool, ConfigError
from pagedkv.managers import CrossAttentionManager
from tests.support.hybrid import cross, full, make_manager, make_request


def test_sized_by_encoder_tokens_and_kept_until_free() -> None:
    manager = make_manager(16, full(4), cross(4), enable_caching=False)
    request = make_request("a", range(5), 4)
    new_blocks = manager.allocate_slots(request, 5, num_encoder_tokens=10)
    assert new_blocks.get_block_ids() == ([1, 2], [3, 4, 5])
    request.num_computed_tokens = 5
    for token in range(4):  # decode to 9 tokens: the decoder grows, the encoder KV stays
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
    assert manager.get_block_ids("a") == ([1, 2, 6], [3, 4, 5])
    manager.check_invariants()
    manager.free(request)
    assert manager.block_pool.get_num_free_blocks() == 15
    # Unhashed blocks return to the head, each group's table last block first.
    assert manager.block_pool.free_block_ids()[:6] == [5, 4, 3, 6, 2, 1]


def test_admission_counts_encoder_blocks() -> None:
    request = make_request("a", range(5), 4)
    fits = make_manager(6, full(4), cross(4), enable_caching=False)  # 5 usable: 2 + 3
    assert (
        fits.allocate_slots(request, 5, num_encoder_tokens=10, full_sequence_must_fit=True)
        is not None
    )
    short = make_manager(5, full(4), cross(4), enable_caching=False)
    assert (
        short.allocate_slots(request, 5, num_encoder_tokens=10, full_sequence_must_fit=True) is None
    )
    assert short.allocate_slots(request, 5, num_encoder_tokens=10) is None
    assert short.block_pool.get_num_free_blocks() == 4


def test_prefix_caching_with_cross_attention_is_rejected_at_construction() -> None:
    with pytest.raises(ConfigError, match="group 1 is cross-attention.*encoder-decoder"):
        make_manager(16, full(4), cross(4))


def test_cross_attention_alone_refuses_a_lookup() -> None:
    manager = make_manager(16, cross(4))  # one group: the unitary coordinator
    with pytest.raises(ConfigError, match="never prefix-cached"):
        manager.get_computed_blocks(make_request("a", range(9), 4))


def test_hit_blocks_are_rejected() -> None:
    pool = BlockPool(8, hash_block_size=4)
    manager = CrossAttentionManager(cross(4), pool, 0, enable_caching=False)
    manager.add_local_computed_blocks("a", [], 0, 0)  # nothing to adopt is fine
    with pytest.raises(ConfigError, match="1 prefix-hit blocks"):
        manager.add_local_computed_blocks("b", [pool.blocks[1]], 4, 0)
    assert "b" not in manager.req_to_blocks and pool.blocks[1].ref_cnt == 0
