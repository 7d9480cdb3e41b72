"""Eviction policy `cost`: prefix-aware, value = reuse x recompute cost, leaves only.

A block's value is its access count times the cost of recomputing it, which grows with its
depth: `1 + end_token / attention_crossover_tokens` (the attention FLOPs of a token grow with
its position; at `attention_crossover_tokens` they equal the token's linear FLOPs, about 32k
tokens for an 8B Llama). Victims are chosen as in `lfu` (lowest `age + value`, the age
rising to each victim's key: GreedyDual-Size-Frequency aging), but only among *leaves*: a
block with a cached child is never evicted while that child remains, since an orphaned child
can never be hit. O(1) per operation (the ring of `lfu`, plus a FIFO of non-leaves).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction.lfu import MAX_ACCESS_COUNT, LFUPolicy
from pagedkv.eviction.prefix_links import PrefixLinks
from pagedkv.free_queue import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels

DEFAULT_ATTENTION_CROSSOVER_TOKENS = 32768
VALUE_UNITS_PER_ACCESS = 2  # value resolution: half an access of a shallow block
MAX_VALUE = 256


class CostPolicy(LFUPolicy):
    """`lfu`'s order over free leaves; free blocks with a cached child wait in `_blocked`.

    Invariants: a free cached block is in the ring iff it has no cached child (a leaf), else
    in `_blocked`; a parent never leaves before its children, except as a documented
    fallback: when every free cached block has a cached child that is *held* (a sliding
    window freed the parent but a request still holds the child), the oldest blocked block
    is evicted, since the pool must hand out every block it counts as free.
    """

    name = "cost"

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        retention: RetentionLevels | None = None,
        attention_crossover_tokens: int = DEFAULT_ATTENTION_CROSSOVER_TOKENS,
    ) -> None:
        if type(attention_crossover_tokens) is not int or attention_crossover_tokens < 1:
            raise ConfigError(
                f"attention_crossover_tokens={attention_crossover_tokens!r} must be an int >= 1"
            )
        super().__init__(blocks, retention, max_value=MAX_VALUE)
        self.attention_crossover_tokens = attention_crossover_tokens
        self._cost = [1.0] * self.num_blocks
        self.links = PrefixLinks(self.num_blocks)
        self._blocked = FreeKVCacheBlockQueue(())
        self._is_blocked = bytearray(self.num_blocks)
        self.num_fallback_evictions = 0

    def _value(self, block: KVCacheBlock) -> int:
        block_id = block.block_id
        return int(
            self._access_count[block_id] * self._cost[block_id] * VALUE_UNITS_PER_ACCESS + 0.5
        )

    def note_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None, end_token: int) -> None:
        super().note_cached(block, parent, end_token)
        self._cost[block.block_id] = 1.0 + end_token / self.attention_crossover_tokens
        self.links.link(block, parent)

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        counts, cost, link = self._access_count, self._cost, self.links.link
        crossover = self.attention_crossover_tokens
        for index in range(start, end):
            block = blocks[index]
            if skipped_ids is not None and id(block) in skipped_ids:
                continue
            block_id = block.block_id
            counts[block_id] = 1
            cost[block_id] = 1.0 + (index + 1) * block_size / crossover
            link(block, blocks[index - 1] if index else None)

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        # Hot path: a request's blocks are freed tail first, so only the tail is a leaf.
        num_children = self.links.num_children
        blocked_append = self._blocked.append
        is_blocked = self._is_blocked
        insert_leaf = super()._insert_cached
        num_blocks = 0
        for block in blocks:
            if num_children[block.block_id]:
                blocked_append(block)
                is_blocked[block.block_id] = 1
            else:
                insert_leaf(block)
            num_blocks += 1
        return num_blocks

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        pop = self._pop_victim
        for _ in range(num_victims):
            out.append(pop())

    def take_hits(self, blocks: Sequence[KVCacheBlock], null_block: KVCacheBlock) -> None:
        if self.retention is not None:
            super().take_hits(blocks, null_block)
            return
        # Hot path: as `lfu`, with the non-leaves' FIFO.
        ring, ring_size, key_of = self._ring, self._ring_size, self._key
        counts, is_blocked = self._access_count, self._is_blocked
        unhashed_remove, blocked_remove = self._unhashed.remove, self._blocked.remove
        num_unhashed = num_ring = num_blocked = 0
        for block in blocks:
            if block is null_block:
                continue
            block_id = block.block_id
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    unhashed_remove(block)
                    num_unhashed += 1
                    continue
                if is_blocked[block_id]:
                    blocked_remove(block)
                    is_blocked[block_id] = 0
                    num_blocked += 1
                else:
                    ring[key_of[block_id] % ring_size].remove(block)
                    num_ring += 1
            count = counts[block_id]
            if count < MAX_ACCESS_COUNT:
                counts[block_id] = count + 1
        self.num_ring_blocks -= num_ring
        self.num_policy_blocks -= num_ring + num_blocked
        self.num_free_blocks -= num_ring + num_blocked + num_unhashed

    def _insert_cached(self, block: KVCacheBlock) -> None:
        if self.links.num_children[block.block_id]:
            self._blocked.append(block)
            self._is_blocked[block.block_id] = 1
        else:
            super()._insert_cached(block)

    def _unlink(self, block: KVCacheBlock) -> None:
        if self._is_blocked[block.block_id]:
            self._blocked.remove(block)
            self._is_blocked[block.block_id] = 0
        else:
            super()._unlink(block)

    def _pop_victim(self) -> KVCacheBlock:
        if self.num_ring_blocks:
            block = self._pop_ring()
        else:
            block = self._blocked.popleft()
            self._is_blocked[block.block_id] = 0
            self.num_fallback_evictions += 1
        self._leave(block)
        return block

    def _forget(self, block: KVCacheBlock) -> None:
        self._leave(block)

    def _leave(self, block: KVCacheBlock) -> None:
        """`block` leaves the cache: its parent may become an evictable leaf."""
        self._access_count[block.block_id] = 0
        parent_id = self.links.unlink(block)
        if parent_id >= 0 and self._is_blocked[parent_id]:
            parent = self.blocks[parent_id]
            self._blocked.remove(parent)
            self._is_blocked[parent_id] = 0
            super()._insert_cached(parent)

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        """The leaves in eviction order, then the blocked parents (which become leaves, and
        take a key, only as their children go)."""
        yield from super()._iter_cached()
        yield from self._blocked

    def _clear(self) -> None:
        super()._clear()
        self.links.clear()
        self._blocked = FreeKVCacheBlockQueue(())
        self._is_blocked = bytearray(self.num_blocks)

    def _check(self) -> None:
        super()._check()
        self._blocked.check_invariants()
        self.links.check_invariants(list(self.blocks))
        for block in self._blocked:
            if not self._is_blocked[block.block_id] or self.links.is_leaf(block):
                raise InvariantViolation(f"cost: blocked block {block.block_id} is a leaf")
        for block in super()._iter_cached():
            if not self.links.is_leaf(block):
                raise InvariantViolation(f"cost: block {block.block_id} in the ring has a child")
