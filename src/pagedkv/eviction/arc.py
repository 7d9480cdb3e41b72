"""Eviction policy `arc`: Adaptive Replacement Cache (Megiddo and Modha, FAST '03).

Cached blocks seen once live in T1, blocks hit again in T2; the hashes of recent victims are
remembered in the ghost lists B1 (from T1) and B2 (from T2). Caching a hash found in B1 means
T1 was too small: the target size `p` of T1 grows (by `max(1, |B2| / |B1|)`); one found in B2
shrinks it; either way the block enters T2. The victim is the least recently freed block of T1
while T1 holds more than `p` blocks, else of T2. The capacity `c` is the pool's usable blocks.
Only free blocks are linked (a held block cannot be evicted), but membership counts held
blocks too, as ARC's sizes do. O(1) per operation.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.errors import InvariantViolation
from pagedkv.eviction.base import EvictionPolicy, ghost_key
from pagedkv.free_queue import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels


class ARCPolicy(EvictionPolicy):
    """T1, T2, the ghosts B1 and B2, and the adaptive target `target_t1_blocks` (ARC's p).

    Invariants: every cached block is a member of T1 or T2 (`_in_t2`), held or free, counted in
    `num_t1_members`/`num_t2_members`; free members are linked in their list, least recently
    freed first; `0 <= p <= c`; `|T1| + |B1| <= c` unless T1 alone is larger; all four lists
    together hold at most `2c` entries.
    """

    name = "arc"

    def __init__(
        self, blocks: Sequence[KVCacheBlock], retention: RetentionLevels | None = None
    ) -> None:
        super().__init__(blocks, retention)
        self.capacity = max(1, self.num_blocks - 1)
        self.target_t1_blocks = 0.0
        self._t1 = FreeKVCacheBlockQueue(())
        self._t2 = FreeKVCacheBlockQueue(())
        self._in_t2 = bytearray(self.num_blocks)
        self.num_t1_members = 0
        self.num_t2_members = 0
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        # Hot path: one C-level set intersection finds the (usually no) ghost hits among the
        # new blocks; the others join T1 (a new block's `_in_t2` is already 0: victims and
        # forgotten blocks reset it). The ghosts are trimmed once for the run. A decode step
        # caches one block: the plain per-block rule is cheaper then.
        if end - start == 1 and skipped_ids is None:
            self.note_cached(blocks[start], None, 0)
            return
        new_blocks = [
            block
            for block in blocks[start:end]
            if skipped_ids is None or id(block) not in skipped_ids
        ]
        keys = [
            block.block_hash if block.hash_group_id == 0 else ghost_key(block)
            for block in new_blocks
        ]
        b1, b2 = self._b1, self._b2
        ghost_hits = (b1.keys() & keys) | (b2.keys() & keys) if b1 or b2 else ()
        if ghost_hits:
            in_t2 = self._in_t2
            capacity = float(self.capacity)
            for block, key in zip(new_blocks, keys, strict=True):
                if key not in ghost_hits:
                    continue
                if key in b1:
                    step = max(1.0, len(b2) / len(b1))
                    self.target_t1_blocks = min(capacity, self.target_t1_blocks + step)
                    del b1[key]
                elif key in b2:
                    step = max(1.0, len(b1) / len(b2))
                    self.target_t1_blocks = max(0.0, self.target_t1_blocks - step)
                    del b2[key]
                else:
                    continue  # a duplicate key within the run, already taken
                in_t2[block.block_id] = 1
                self.num_t2_members += 1
                self.num_t1_members -= 1
        self.num_t1_members += len(new_blocks)
        self._trim_ghosts()

    def note_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None, end_token: int) -> None:
        key = ghost_key(block)
        b1, b2 = self._b1, self._b2
        if key in b1:
            step = max(1.0, len(b2) / len(b1))
            self.target_t1_blocks = min(float(self.capacity), self.target_t1_blocks + step)
            del b1[key]
        elif key in b2:
            step = max(1.0, len(b1) / len(b2))
            self.target_t1_blocks = max(0.0, self.target_t1_blocks - step)
            del b2[key]
        else:
            self._in_t2[block.block_id] = 0
            self.num_t1_members += 1
            self._trim_ghosts()
            return
        self._in_t2[block.block_id] = 1
        self.num_t2_members += 1
        self._trim_ghosts()

    def note_hit(self, block: KVCacheBlock) -> None:
        # Called after `_unlink` for a free block, so the block leaves T1's list first.
        if not self._in_t2[block.block_id]:
            self._in_t2[block.block_id] = 1
            self.num_t1_members -= 1
            self.num_t2_members += 1

    def _insert_cached(self, block: KVCacheBlock) -> None:
        (self._t2 if self._in_t2[block.block_id] else self._t1).append(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        (self._t2 if self._in_t2[block.block_id] else self._t1).remove(block)

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        in_t2 = self._in_t2
        to_t1: list[KVCacheBlock] = []
        to_t2: list[KVCacheBlock] = []
        for block in blocks:
            (to_t2 if in_t2[block.block_id] else to_t1).append(block)
        if to_t1:
            self._t1.append_n(to_t1)
        if to_t2:
            self._t2.append_n(to_t2)
        return len(to_t1) + len(to_t2)

    def take_hits(self, blocks: Sequence[KVCacheBlock], null_block: KVCacheBlock) -> None:
        if self._guarded:
            super().take_hits(blocks, null_block)
            return
        # Hot path: `remove` / `on_hit_held` inlined (a lookup's hits are adopted together).
        in_t2 = self._in_t2
        t1_remove, t2_remove = self._t1.remove, self._t2.remove
        unhashed_remove = self._unhashed.remove
        num_unhashed = num_cached = num_promoted = 0
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
                (t2_remove if in_t2[block_id] else t1_remove)(block)
                num_cached += 1
            if not in_t2[block_id]:
                in_t2[block_id] = 1
                num_promoted += 1
            block.ref_cnt += 1
        self.num_t1_members -= num_promoted
        self.num_t2_members += num_promoted
        self.num_policy_blocks -= num_cached
        self.num_free_blocks -= num_cached + num_unhashed

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        """`_pop_victim` in batches: the victims of one list, while the rule keeps choosing it."""
        if num_victims == 1:  # a decode step's new block: no batch to set up
            out.append(self._pop_victim())
            return
        t1, t2 = self._t1, self._t2
        b1, b2, in_t2 = self._b1, self._b2, self._in_t2
        num_left = num_victims
        while num_left:
            num_t1 = self.num_t1_members
            if t1.num_free_blocks and (num_t1 > self.target_t1_blocks or not t2.num_free_blocks):
                num_taken = min(num_left, t1.num_free_blocks)
                if t2.num_free_blocks:
                    # T1 stays the source while it holds more than the target.
                    num_taken = min(num_taken, math.ceil(num_t1 - self.target_t1_blocks))
                taken = t1.popleft_n(num_taken)
                b1.update(
                    (block.block_hash if block.hash_group_id == 0 else ghost_key(block), None)
                    for block in taken
                )
                out += taken
                self.num_t1_members -= num_taken
            else:
                # Taking from T2 leaves |T1| alone, so the rule keeps choosing T2.
                num_taken = min(num_left, t2.num_free_blocks)
                taken = t2.popleft_n(num_taken)
                for block in taken:
                    in_t2[block.block_id] = 0
                b2.update(
                    (block.block_hash if block.hash_group_id == 0 else ghost_key(block), None)
                    for block in taken
                )
                out += taken
                self.num_t2_members -= num_taken
            num_left -= num_taken
            self._trim_ghosts()

    def _pop_victim(self) -> KVCacheBlock:
        t1, t2 = self._t1, self._t2
        if t1.num_free_blocks and (
            self.num_t1_members > self.target_t1_blocks or not t2.num_free_blocks
        ):
            block = t1.popleft()
            self.num_t1_members -= 1
            self._b1[ghost_key(block)] = None
        else:
            block = t2.popleft()
            self._in_t2[block.block_id] = 0
            self.num_t2_members -= 1
            self._b2[ghost_key(block)] = None
        self._trim_ghosts()
        return block

    def _trim_ghosts(self) -> None:
        b1, b2, capacity = self._b1, self._b2, self.capacity
        while b1 and len(b1) + self.num_t1_members > capacity:
            b1.popitem(last=False)
        while (b1 or b2) and (
            self.num_t1_members + self.num_t2_members + len(b1) + len(b2) > 2 * capacity
        ):
            (b2 if b2 else b1).popitem(last=False)

    def _forget(self, block: KVCacheBlock) -> None:
        if self._in_t2[block.block_id]:
            self.num_t2_members -= 1
        else:
            self.num_t1_members -= 1
        self._in_t2[block.block_id] = 0

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        """Exact eviction order (T1's size shrinks as T1 is evicted; p is fixed meanwhile)."""
        t1 = list(self._t1)
        t2 = list(self._t2)
        num_t1 = self.num_t1_members
        t1_index = t2_index = 0
        while t1_index < len(t1) or t2_index < len(t2):
            if t1_index < len(t1) and (num_t1 > self.target_t1_blocks or t2_index >= len(t2)):
                yield t1[t1_index]
                t1_index += 1
                num_t1 -= 1
            else:
                yield t2[t2_index]
                t2_index += 1

    def _clear(self) -> None:
        self._t1 = FreeKVCacheBlockQueue(())
        self._t2 = FreeKVCacheBlockQueue(())
        self._in_t2 = bytearray(self.num_blocks)
        self.num_t1_members = self.num_t2_members = 0

    def _check(self) -> None:
        self._check_two_queues(
            (self._t1, self._t2),
            self._in_t2,
            (self.num_t1_members, self.num_t2_members),
            "T1 and T2",
        )
        if not 0.0 <= self.target_t1_blocks <= self.capacity:
            raise InvariantViolation(f"arc: target {self.target_t1_blocks} outside [0, c]")
        total = self.num_t1_members + self.num_t2_members + len(self._b1) + len(self._b2)
        if total > 2 * self.capacity:
            raise InvariantViolation(f"arc: {total} entries > 2c = {2 * self.capacity}")
