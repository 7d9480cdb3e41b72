"""FreeKVCacheBlockQueue: every primitive, with exact orders and link states."""

from __future__ import annotations

import pytest

from pagedkv import FreeKVCacheBlockQueue, InvalidArgumentError, KVCacheBlock
from pagedkv.errors import InvariantViolation, PagedKVError


def make_queue(num_blocks: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(num_blocks)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def assert_unlinked(*blocks: KVCacheBlock) -> None:
    for block in blocks:
        assert block.prev_free_block is None and block.next_free_block is None


def test_initial_order_is_block_id_order_and_links_are_set():
    blocks, queue = make_queue(5)
    assert ids(queue) == [0, 1, 2, 3, 4]
    assert len(queue) == queue.num_free_blocks == 5
    assert blocks[0].prev_free_block is queue.fake_free_list_head
    assert blocks[4].next_free_block is queue.fake_free_list_tail
    assert blocks[2].prev_free_block is blocks[1] and blocks[2].next_free_block is blocks[3]
    assert queue.get_all_free_blocks() == blocks
    queue.check_invariants()


def test_empty_queue():
    _, queue = make_queue(0)
    assert ids(queue) == []
    assert len(queue) == 0
    queue.check_invariants()
    with pytest.raises(InvalidArgumentError, match="No free blocks"):
        queue.popleft()
    assert queue.popleft_n(0) == []


def test_popleft_returns_head_and_unlinks_it():
    blocks, queue = make_queue(4)
    assert queue.popleft() is blocks[0]
    assert_unlinked(blocks[0])
    assert queue.popleft() is blocks[1]
    assert ids(queue) == [2, 3]
    assert queue.num_free_blocks == 2
    assert blocks[2].prev_free_block is queue.fake_free_list_head
    queue.check_invariants()


def test_popleft_until_empty_then_error_is_a_pagedkv_value_error():
    blocks, queue = make_queue(2)
    queue.popleft()
    queue.popleft()
    with pytest.raises(InvalidArgumentError) as info:
        queue.popleft()
    assert isinstance(info.value, PagedKVError) and isinstance(info.value, ValueError)
    assert queue.num_free_blocks == 0
    queue.check_invariants()


def test_popleft_n_exact_order_and_relinks_rest():
    blocks, queue = make_queue(6)
    popped = queue.popleft_n(3)
    assert [b.block_id for b in popped] == [0, 1, 2]
    assert_unlinked(*popped)
    assert ids(queue) == [3, 4, 5]
    assert blocks[3].prev_free_block is queue.fake_free_list_head
    assert queue.num_free_blocks == 3
    queue.check_invariants()
    # Popping everything leaves the sentinels linked to each other.
    rest = queue.popleft_n(3)
    assert [b.block_id for b in rest] == [3, 4, 5]
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head
    queue.check_invariants()


def test_popleft_n_zero_changes_nothing():
    _, queue = make_queue(3)
    assert queue.popleft_n(0) == []
    assert ids(queue) == [0, 1, 2]
    assert queue.num_free_blocks == 3


def test_popleft_n_too_many_raises_naming_counts_and_changes_nothing():
    _, queue = make_queue(3)
    with pytest.raises(InvalidArgumentError, match=r"cannot pop 4 blocks: only 3"):
        queue.popleft_n(4)
    assert ids(queue) == [0, 1, 2]
    assert queue.num_free_blocks == 3
    queue.check_invariants()


def test_append_links_at_tail():
    blocks, queue = make_queue(4)
    a, b = queue.popleft(), queue.popleft()
    queue.append(a)
    assert ids(queue) == [2, 3, 0]
    queue.append(b)
    assert ids(queue) == [2, 3, 0, 1]
    assert b.next_free_block is queue.fake_free_list_tail
    assert queue.num_free_blocks == 4
    queue.check_invariants()


def test_append_into_empty_queue():
    blocks, queue = make_queue(2)
    popped = queue.popleft_n(2)
    queue.append(popped[1])
    assert ids(queue) == [1]
    assert popped[1].prev_free_block is queue.fake_free_list_head
    queue.check_invariants()


def test_append_n_keeps_given_order_at_tail():
    blocks, queue = make_queue(6)
    popped = queue.popleft_n(4)  # 0 1 2 3
    queue.append_n([popped[2], popped[0], popped[3]])
    assert ids(queue) == [4, 5, 2, 0, 3]
    assert queue.num_free_blocks == 5
    queue.check_invariants()
    queue.append_n([])
    assert ids(queue) == [4, 5, 2, 0, 3]
    assert queue.num_free_blocks == 5
    queue.check_invariants()


def test_append_n_accepts_an_iterator():
    blocks, queue = make_queue(4)
    popped = queue.popleft_n(3)
    queue.append_n(reversed(popped))
    assert ids(queue) == [3, 2, 1, 0]
    queue.check_invariants()


def test_append_n_into_empty_queue():
    blocks, queue = make_queue(3)
    popped = queue.popleft_n(3)
    queue.append_n(popped[::-1])
    assert ids(queue) == [2, 1, 0]
    queue.check_invariants()


def test_prepend_n_keeps_given_order_at_head():
    blocks, queue = make_queue(6)
    popped = queue.popleft_n(3)  # 0 1 2
    queue.prepend_n([popped[1], popped[2]])
    assert ids(queue) == [1, 2, 3, 4, 5]
    queue.prepend_n(iter([popped[0]]))
    assert ids(queue) == [0, 1, 2, 3, 4, 5]
    assert queue.num_free_blocks == 6
    queue.check_invariants()
    queue.prepend_n([])
    assert ids(queue) == [0, 1, 2, 3, 4, 5]
    queue.check_invariants()


def test_prepend_n_into_empty_queue():
    blocks, queue = make_queue(3)
    popped = queue.popleft_n(3)
    queue.prepend_n([popped[2], popped[0]])
    assert ids(queue) == [2, 0]
    assert popped[0].next_free_block is queue.fake_free_list_tail
    queue.check_invariants()


def test_remove_middle_head_and_tail_in_place():
    blocks, queue = make_queue(5)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert_unlinked(blocks[2])
    assert blocks[1].next_free_block is blocks[3] and blocks[3].prev_free_block is blocks[1]
    queue.remove(blocks[0])
    assert ids(queue) == [1, 3, 4]
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert queue.num_free_blocks == 2
    queue.check_invariants()


def test_remove_unlinked_block_raises_and_changes_nothing():
    blocks, queue = make_queue(3)
    block = queue.popleft()
    with pytest.raises(InvariantViolation, match="block 0"):
        queue.remove(block)
    assert ids(queue) == [1, 2]
    assert queue.num_free_blocks == 2
    queue.check_invariants()


def test_remove_then_append_moves_block_to_tail():
    blocks, queue = make_queue(4)
    queue.remove(blocks[1])
    queue.append(blocks[1])
    assert ids(queue) == [0, 2, 3, 1]
    queue.check_invariants()


def test_iteration_does_not_consume_and_is_head_first():
    blocks, queue = make_queue(3)
    assert ids(queue) == [0, 1, 2]
    assert ids(queue) == [0, 1, 2]
    assert list(iter(queue)) == blocks


def test_mixed_sequence_exact_order():
    blocks, queue = make_queue(8)
    popped = queue.popleft_n(5)  # 0..4 out; queue: 5 6 7
    queue.prepend_n([popped[4], popped[3]])  # 4 3 5 6 7
    queue.append_n([popped[0], popped[1]])  # 4 3 5 6 7 0 1
    queue.remove(blocks[6])  # 4 3 5 7 0 1
    queue.append(popped[2])  # 4 3 5 7 0 1 2
    assert ids(queue) == [4, 3, 5, 7, 0, 1, 2]
    assert queue.popleft() is blocks[4]
    assert [b.block_id for b in queue.popleft_n(2)] == [3, 5]
    assert ids(queue) == [7, 0, 1, 2]
    assert queue.num_free_blocks == 4
    queue.check_invariants()


def test_check_invariants_detects_counter_drift():
    _, queue = make_queue(3)
    queue.num_free_blocks = 2
    with pytest.raises(InvariantViolation):
        queue.check_invariants()


def test_check_invariants_detects_broken_back_link():
    blocks, queue = make_queue(3)
    blocks[2].prev_free_block = blocks[0]
    with pytest.raises(InvariantViolation, match="forward links"):
        queue.check_invariants()


def test_popleft_n_negative_raises_and_changes_nothing():
    _, queue = make_queue(3)
    with pytest.raises(InvalidArgumentError, match="-1"):
        queue.popleft_n(-1)
    assert ids(queue) == [0, 1, 2]
    assert queue.num_free_blocks == 3
    queue.check_invariants()
