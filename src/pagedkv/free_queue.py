"""Leaf: the free-block queue, an intrusive doubly linked list that *is* the eviction order.

The head is evicted (reused) first. The queue allocates nothing per operation: links live in
the blocks' own slots, and two sentinel nodes remove every end-of-list branch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.errors import InvalidArgumentError, InvariantViolation


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head first).

    Invariants: `num_free_blocks` equals the number of linked blocks; a block is linked iff both
    its links are set; the sentinels are never handed out.

    Typing: a link is `KVCacheBlock | None` (None off the queue), but the links of the sentinels
    and of linked blocks are never None. The batch operations rely on that without a per-block
    check; their `# type: ignore[...]  # linked` comments mark exactly those reads.
    """

    __slots__ = ("num_free_blocks", "fake_free_list_head", "fake_free_list_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        # Sentinels carry block_id -1; they never leave this class.
        self.fake_free_list_head = KVCacheBlock(block_id=-1)
        self.fake_free_list_tail = KVCacheBlock(block_id=-1)
        prev = self.fake_free_list_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        """Unlink and return the head block (the next to be reused)."""
        head = self.fake_free_list_head
        block = head.next_free_block
        if block is self.fake_free_list_tail or block is None:
            raise InvalidArgumentError("No free blocks available")
        nxt = block.next_free_block
        if nxt is None:
            raise InvariantViolation(f"free block {block.block_id} has no next link")
        head.next_free_block = nxt
        nxt.prev_free_block = head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Unlink and return the first `num_blocks` blocks, head first."""
        if num_blocks <= 0:
            if num_blocks < 0:
                # A negative count would silently inflate num_free_blocks.
                raise InvalidArgumentError(
                    f"cannot pop {num_blocks} blocks: the count must be >= 0"
                )
            return []
        if num_blocks > self.num_free_blocks:
            raise InvalidArgumentError(
                f"cannot pop {num_blocks} blocks: only {self.num_free_blocks} are free"
            )
        # Hot path: one pass, relinking the list once at the end instead of per block.
        head = self.fake_free_list_head
        result: list[KVCacheBlock] = [None] * num_blocks  # type: ignore[list-item]  # set below
        curr: KVCacheBlock = head.next_free_block  # type: ignore[assignment]  # linked
        for i in range(num_blocks):
            result[i] = curr
            last = curr
            # num_blocks <= num_free_blocks: at worst this reaches the tail sentinel.
            curr = curr.next_free_block  # type: ignore[assignment]  # linked
            last.prev_free_block = last.next_free_block = None
        head.next_free_block = curr
        curr.prev_free_block = head
        self.num_free_blocks -= num_blocks
        return result

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it is in the queue, in O(1)."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise InvariantViolation(
                f"remove() called on block {block.block_id}, which is not free"
            )
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link `block` at the tail (reused last)."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        last.next_free_block = block  # type: ignore[union-attr]  # linked
        block.prev_free_block = last
        block.next_free_block = tail
        tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Link `blocks` at the tail, keeping their order."""
        tail = self.fake_free_list_tail
        last = tail.prev_free_block
        count = 0
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block  # type: ignore[union-attr]  # linked
            last = block
            count += 1
        last.next_free_block = tail  # type: ignore[union-attr]  # linked
        tail.prev_free_block = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Link `blocks` at the head, keeping their order (the first given is reused first)."""
        head = self.fake_free_list_head
        first = head.next_free_block
        last = head
        count = 0
        for block in blocks:
            block.prev_free_block = last
            last.next_free_block = block
            last = block
            count += 1
        last.next_free_block = first
        first.prev_free_block = last  # type: ignore[union-attr]  # linked
        self.num_free_blocks += count

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Iterate head to tail (do not mutate the queue while iterating)."""
        tail = self.fake_free_list_tail
        curr = self.fake_free_list_head.next_free_block
        while curr is not tail and curr is not None:
            yield curr
            curr = curr.next_free_block

    def __len__(self) -> int:
        return self.num_free_blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head (next to reuse) first."""
        return list(self)

    def check_invariants(self) -> None:
        """Walk the list both ways and check the links and the counter."""
        forward = []
        curr = self.fake_free_list_head.next_free_block
        prev = self.fake_free_list_head
        while curr is not self.fake_free_list_tail:
            if curr is None or curr.prev_free_block is not prev:
                raise InvariantViolation("free queue: broken forward links")
            forward.append(curr)
            prev, curr = curr, curr.next_free_block
            if len(forward) > self.num_free_blocks:
                raise InvariantViolation("free queue: longer than num_free_blocks (cycle?)")
        if self.fake_free_list_tail.prev_free_block is not prev:
            raise InvariantViolation("free queue: tail sentinel not linked to the last block")
        if len(forward) != self.num_free_blocks:
            raise InvariantViolation(
                f"free queue: {len(forward)} linked blocks but num_free_blocks="
                f"{self.num_free_blocks}"
            )
        if len({id(b) for b in forward}) != len(forward):
            raise InvariantViolation("free queue: a block is linked twice")
