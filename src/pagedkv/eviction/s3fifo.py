"""Eviction policy `s3fifo`: three static FIFO queues (Yang et al., SOSP '23).

New blocks enter a small FIFO S (a tenth of the pool); a block reaching the end of S is moved
to the main FIFO M if it was hit since it entered, else evicted and its hash remembered in a
ghost FIFO G. A block whose hash is in G when it is cached again enters M directly. M is a
CLOCK with a 2-bit counter: a hit block at the end of M goes round again with one count less.
Only free blocks sit in the queues (a held block cannot be evicted); a block keeps its queue
while held and re-enters it at the new end when freed. O(1) amortised per operation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.errors import InvariantViolation
from pagedkv.eviction.base import EvictionPolicy, ghost_key
from pagedkv.free_queue import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels

SMALL_FRACTION = 0.1
MAX_HITS = 3  # the 2-bit counter of the paper

_SMALL = 0
_MAIN = 1


class S3FIFOPolicy(EvictionPolicy):
    """S (small), M (main) and the ghost G.

    Invariants: every cached block is a member of S or M (`_queue_of`), held or free;
    `num_small_members`/`num_main_members` count the members; free members are linked in
    their queue, oldest first; G holds at most `ghost_capacity` keys, oldest first.
    """

    name = "s3fifo"

    def __init__(
        self, blocks: Sequence[KVCacheBlock], retention: RetentionLevels | None = None
    ) -> None:
        super().__init__(blocks, retention)
        num_usable = max(1, self.num_blocks - 1)
        self.small_target = max(1, int(SMALL_FRACTION * num_usable))
        self.ghost_capacity = max(1, num_usable - self.small_target)
        self._small = FreeKVCacheBlockQueue(())
        self._main = FreeKVCacheBlockQueue(())
        self._queue_of = bytearray(self.num_blocks)
        self._hits = bytearray(self.num_blocks)
        self._ghost: OrderedDict[Hashable, None] = OrderedDict()
        self.num_small_members = 0
        self.num_main_members = 0

    def note_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None, end_token: int) -> None:
        block_id = block.block_id
        key = ghost_key(block)
        if key in self._ghost:
            del self._ghost[key]
            self._queue_of[block_id] = _MAIN
            self.num_main_members += 1
        else:
            self._queue_of[block_id] = _SMALL
            self.num_small_members += 1
        self._hits[block_id] = 0

    def note_hit(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        if self._hits[block_id] < MAX_HITS:
            self._hits[block_id] += 1

    def _insert_cached(self, block: KVCacheBlock) -> None:
        if self._queue_of[block.block_id] == _MAIN:
            self._main.append(block)
        else:
            self._small.append(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        if self._queue_of[block.block_id] == _MAIN:
            self._main.remove(block)
        else:
            self._small.remove(block)

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        # Hot path: `note_cached` inlined for group 0 (the ghost key is the hash itself).
        ghost, queue_of, hits = self._ghost, self._queue_of, self._hits
        num_main = 0
        num_small = 0
        for index in range(start, end):
            block = blocks[index]
            if skipped_ids is not None and id(block) in skipped_ids:
                continue
            block_id = block.block_id
            key = block.block_hash if block.hash_group_id == 0 else ghost_key(block)
            if key in ghost:
                del ghost[key]
                queue_of[block_id] = _MAIN
                num_main += 1
            else:
                queue_of[block_id] = _SMALL
                num_small += 1
            hits[block_id] = 0
        self.num_main_members += num_main
        self.num_small_members += num_small

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        queue_of = self._queue_of
        to_small: list[KVCacheBlock] = []
        to_main: list[KVCacheBlock] = []
        for block in blocks:
            (to_main if queue_of[block.block_id] == _MAIN else to_small).append(block)
        if to_small:
            self._small.append_n(to_small)
        if to_main:
            self._main.append_n(to_main)
        return len(to_small) + len(to_main)

    def take_hits(self, blocks: Sequence[KVCacheBlock], null_block: KVCacheBlock) -> None:
        if self._guarded:
            super().take_hits(blocks, null_block)
            return
        # Hot path: `remove` / `on_hit_held` inlined (a lookup's hits are adopted together).
        queue_of, hits = self._queue_of, self._hits
        small_remove, main_remove = self._small.remove, self._main.remove
        unhashed_remove = self._unhashed.remove
        num_unhashed = num_cached = 0
        for block in blocks:
            if block is null_block:
                continue
            block_id = block.block_id
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed_remove(block)
                    num_unhashed += 1
                    block.ref_cnt = 1
                    continue
                (main_remove if queue_of[block_id] == _MAIN else small_remove)(block)
                num_cached += 1
            if hits[block_id] < MAX_HITS:
                hits[block_id] += 1
            block.ref_cnt += 1
        self.num_policy_blocks -= num_cached
        self.num_free_blocks -= num_cached + num_unhashed

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        """`_pop_victim` in batches: a run of S (or M) blocks is taken at once when no rule
        could change between them (the same victims, in the same order)."""
        if num_victims == 1:  # a decode step's new block: no batch to set up
            out.append(self._pop_victim())
            return
        small, main = self._small, self._main
        hits, queue_of = self._hits, self._queue_of
        ghost, ghost_capacity = self._ghost, self.ghost_capacity
        num_left = num_victims
        while num_left:
            num_small = self.num_small_members
            if small.num_free_blocks and (
                num_small >= self.small_target or not main.num_free_blocks
            ):
                # Each block taken leaves S, so S stays the source while it is at its target
                # (below it, S is the source only while M is empty: one block at a time).
                num_taken = 1
                if num_small >= self.small_target:
                    num_taken = min(
                        num_left, small.num_free_blocks, num_small - self.small_target + 1
                    )
                promoted = []
                for block in small.popleft_n(num_taken):
                    block_id = block.block_id
                    if hits[block_id]:
                        hits[block_id] = 0
                        queue_of[block_id] = _MAIN
                        promoted.append(block)
                        continue
                    block_hash = block.block_hash
                    ghost[block_hash if block.hash_group_id == 0 else ghost_key(block)] = None
                    out.append(block)
                    num_left -= 1
                while len(ghost) > ghost_capacity:
                    ghost.popitem(last=False)
                self.num_small_members -= num_taken
                if promoted:
                    self.num_main_members += len(promoted)
                    main.append_n(promoted)
                continue
            again = []
            for block in main.popleft_n(min(num_left, main.num_free_blocks)):
                block_id = block.block_id
                if hits[block_id]:
                    hits[block_id] -= 1
                    again.append(block)
                    continue
                self.num_main_members -= 1
                out.append(block)
                num_left -= 1
            if again:
                main.append_n(again)

    def _pop_victim(self) -> KVCacheBlock:
        small, main = self._small, self._main
        hits, queue_of = self._hits, self._queue_of
        while True:
            if small.num_free_blocks and (
                self.num_small_members >= self.small_target or not main.num_free_blocks
            ):
                block = small.popleft()
                block_id = block.block_id
                if hits[block_id]:
                    # Hit while in S: promote to M with its counter cleared.
                    hits[block_id] = 0
                    queue_of[block_id] = _MAIN
                    self.num_small_members -= 1
                    self.num_main_members += 1
                    main.append(block)
                    continue
                self.num_small_members -= 1
                self._remember(block)
                return block
            block = main.popleft()
            block_id = block.block_id
            if hits[block_id]:
                hits[block_id] -= 1
                main.append(block)
                continue
            self.num_main_members -= 1
            return block

    def _remember(self, block: KVCacheBlock) -> None:
        """Add an S victim's key to the ghost FIFO, dropping the oldest beyond capacity."""
        ghost = self._ghost
        ghost[block.block_hash if block.hash_group_id == 0 else ghost_key(block)] = None
        if len(ghost) > self.ghost_capacity:
            ghost.popitem(last=False)

    def _forget(self, block: KVCacheBlock) -> None:
        if self._queue_of[block.block_id] == _MAIN:
            self.num_main_members -= 1
        else:
            self.num_small_members -= 1
        self._queue_of[block.block_id] = _SMALL
        self._hits[block.block_id] = 0

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        """The eviction order, simulated on copies (promotions and second chances included)."""
        small = [block for block in self._small]
        main = [block for block in self._main]
        hits = {block.block_id: self._hits[block.block_id] for block in small + main}
        num_small = self.num_small_members
        small_index = 0
        main_index = 0
        while small_index < len(small) or main_index < len(main):
            if small_index < len(small) and (
                num_small >= self.small_target or main_index >= len(main)
            ):
                block = small[small_index]
                small_index += 1
                num_small -= 1
                if hits[block.block_id]:
                    hits[block.block_id] = 0
                    main.append(block)
                    continue
                yield block
                continue
            block = main[main_index]
            main_index += 1
            if hits[block.block_id]:
                hits[block.block_id] -= 1
                main.append(block)
                continue
            yield block

    def _clear(self) -> None:
        self._small = FreeKVCacheBlockQueue(())
        self._main = FreeKVCacheBlockQueue(())
        self._queue_of = bytearray(self.num_blocks)
        self._hits = bytearray(self.num_blocks)
        self.num_small_members = self.num_main_members = 0

    def _check(self) -> None:
        self._check_two_queues(
            (self._small, self._main),
            self._queue_of,
            (self.num_small_members, self.num_main_members),
            "S and M",
        )
        if len(self._ghost) > self.ghost_capacity:
            raise InvariantViolation("s3fifo: the ghost FIFO is over capacity")
