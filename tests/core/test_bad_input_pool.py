"""Misuse of the pool and result types: a clear error, and every structure left as it was."""

from __future__ import annotations

import pytest

from pagedkv import GroupIndexError, InvalidArgumentError
from tests.support.builders import admit, make_manager, make_request, snapshot


def test_freeing_popped_blocks_twice_raises_and_changes_nothing():
    manager = make_manager(20, block_size=4)
    request = make_request("r", list(range(9)), block_size=4)
    admit(manager, request)
    blocks = manager.pop_blocks_for_free(request)
    manager.block_pool.free_blocks(reversed(blocks))
    before = snapshot(manager)
    with pytest.raises(InvalidArgumentError, match=r"block 3 is already free"):
        manager.block_pool.free_blocks(reversed(blocks))
    assert snapshot(manager) == before
    manager.check_invariants()


def test_a_block_twice_in_one_free_call_is_undone_whole():
    manager = make_manager(20, block_size=4)
    request = make_request("r", list(range(9)), block_size=4)
    admit(manager, request)
    blocks = manager.pop_blocks_for_free(request)
    before = [block.ref_cnt for block in manager.block_pool.blocks]
    free_before = manager.block_pool.free_block_ids()
    with pytest.raises(InvalidArgumentError, match=r"block 1 is already free"):
        manager.block_pool.free_blocks([blocks[2], blocks[1], blocks[0], blocks[0]])
    assert [block.ref_cnt for block in manager.block_pool.blocks] == before
    assert manager.block_pool.free_block_ids() == free_before


@pytest.mark.parametrize("bad_id", [True, 1.0, "1"])
def test_evict_blocks_rejects_non_int_ids(bad_id):
    manager = make_manager(20, block_size=4)
    admit(manager, make_request("r", list(range(9)), block_size=4))
    before = snapshot(manager)
    with pytest.raises(InvalidArgumentError, match=repr(bad_id).replace(".", r"\.")):
        manager.evict_blocks({bad_id})
    assert snapshot(manager) == before


@pytest.mark.parametrize("bad_group", ["0", 1.5, -1, 1])
def test_get_block_ids_rejects_bad_group_ids(bad_group):
    manager = make_manager(20, block_size=4)
    request = make_request("r", list(range(9)), block_size=4)
    admit(manager, request)
    with pytest.raises(GroupIndexError, match="group index"):
        manager.get_blocks("r").get_block_ids(group_ids=[bad_group])
