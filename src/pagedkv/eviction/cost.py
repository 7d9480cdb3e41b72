"""Eviction policy `cost`: prefix-aware, value = reuse x recompute cost, children first.

A block's value is its access count times the cost of recomputing it, which grows with its
depth: `1 + end_token / attention_crossover_tokens` (the attention FLOPs of a token grow with
its position; at `attention_crossover_tokens` they equal the token's linear FLOPs, about 32k
tokens for an 8B Llama). Its key is `age + value` when it is freed, as in `lfu`
(GreedyDual-Size-Frequency aging), raised to the highest key any of its cached children was
freed with: a prefix is worth what its most valuable continuation is worth, and since a
parent is never freed before its children (a request holding a child holds its parent), the
lowest key first, oldest first among equals, never evicts a parent while a cached child is
free. O(1): `lfu`'s ring, plus one parent link per block.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import KVCacheBlock
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction.lfu import LFUPolicy

if TYPE_CHECKING:
    from pagedkv.eviction.retention_levels import RetentionLevels

DEFAULT_ATTENTION_CROSSOVER_TOKENS = 32768
VALUE_UNITS_PER_ACCESS = 2  # value resolution: half an access of a shallow block
MAX_VALUE = 256


class CostPolicy(LFUPolicy):
    """`lfu`'s ring with chain-monotone keys.

    Invariants: a block's parent link is live while the parent keeps the cache identity it
    had when the block was cached (`_gen` unchanged); `_child_key[p]` is at least the key
    every child of p with a live link was last freed with; so, among free cached blocks, a
    child is always ahead of its parent in the eviction order. Documented exception: a parent
    freed while a child is *held* (a sliding window frees the blocks it slid past) can be
    evicted before that child, as any block the pool counts as free must be.
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
        num_blocks = self.num_blocks
        self._cost = [1.0] * num_blocks
        self._parent_id = [-1] * num_blocks
        self._parent_gen = [0] * num_blocks
        self._gen = [0] * num_blocks
        self._child_key = [0] * num_blocks

    def _value(self, block: KVCacheBlock) -> int:
        block_id = block.block_id
        return int(
            self._access_count[block_id] * self._cost[block_id] * VALUE_UNITS_PER_ACCESS + 0.5
        )

    def note_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None, end_token: int) -> None:
        block_id = block.block_id
        self._access_count[block_id] = 1
        self._child_key[block_id] = 0
        self._cost[block_id] = 1.0 + end_token / self.attention_crossover_tokens
        self._link(block, parent)

    def _link(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        block_id = block.block_id
        if (
            parent is None
            or parent.block_hash is None
            or (parent.hash_group_id != block.hash_group_id)
        ):
            self._parent_id[block_id] = -1
        else:
            self._parent_id[block_id] = parent.block_id
            self._parent_gen[block_id] = self._gen[parent.block_id]

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        # Hot path: `note_cached` inlined. The parent of each block is the one before it; after
        # the first, that parent was cached in this very run (same group, hashed), unless the
        # run skipped blocks (null padding, blocks cached before), which takes the full check.
        counts, cost, child_key = self._access_count, self._cost, self._child_key
        parent_ids, parent_gens, gens = self._parent_id, self._parent_gen, self._gen
        tokens_per_cost = block_size / self.attention_crossover_tokens
        if skipped_ids is not None:
            end_token = (start + 1) * block_size
            for index in range(start, end):
                block = blocks[index]
                if id(block) not in skipped_ids:
                    self.note_cached(block, blocks[index - 1] if index else None, end_token)
                end_token += block_size
            return
        first = blocks[start]
        self.note_cached(first, blocks[start - 1] if start else None, (start + 1) * block_size)
        parent_id = first.block_id
        for index in range(start + 1, end):
            block_id = blocks[index].block_id
            counts[block_id] = 1
            child_key[block_id] = 0
            cost[block_id] = 1.0 + (index + 1) * tokens_per_cost
            parent_ids[block_id] = parent_id
            parent_gens[block_id] = gens[parent_id]
            parent_id = block_id

    def _insert_cached(self, block: KVCacheBlock) -> None:
        self._insert_many((block,))

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        # Hot path: keys computed inline; a request's blocks come tail first, so each child
        # raises its parent's floor before the parent's own key is computed.
        ring, ring_size, key_of = self._ring, self._ring_size, self._key
        counts, cost, child_key = self._access_count, self._cost, self._child_key
        parent_ids, parent_gens, gens = self._parent_id, self._parent_gen, self._gen
        age, max_value = self.age, self._max_value
        num_blocks = 0
        run: list[KVCacheBlock] = []
        run_key = -1
        for block in blocks:
            block_id = block.block_id
            value = int(counts[block_id] * cost[block_id] * VALUE_UNITS_PER_ACCESS + 0.5)
            key = age + (value if value < max_value else max_value)
            floor = child_key[block_id]
            if floor > key:
                key = floor  # a child's key: at most age + max_value, as every live key
            key_of[block_id] = key
            if key != run_key:
                if run:
                    ring[run_key % ring_size].append_n(run)
                    num_blocks += len(run)
                run = [block]
                run_key = key
            else:
                run.append(block)
            parent_id = parent_ids[block_id]
            if (
                parent_id >= 0
                and parent_gens[block_id] == gens[parent_id]
                and key > child_key[parent_id]
            ):
                child_key[parent_id] = key
        if run:
            ring[run_key % ring_size].append_n(run)
            num_blocks += len(run)
        self.num_ring_blocks += num_blocks
        return num_blocks

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        # Hot path: `lfu`'s batched victims; a victim only moves its generation on (its
        # children's links go stale); its own link, floor and count are reset when it is
        # cached again (`_note_cached_range`).
        if num_victims > self.num_ring_blocks:
            raise InvariantViolation(f"cost: {num_victims} victims wanted from the ring")
        ring, ring_size, gens = self._ring, self._ring_size, self._gen
        key = self.age
        num_left = num_victims
        while num_left:
            queue = ring[key % ring_size]
            num_taken = queue.num_free_blocks
            if not num_taken:
                key += 1
                continue
            if num_taken > num_left:
                num_taken = num_left
            taken = queue.popleft_n(num_taken)
            for block in taken:
                gens[block.block_id] += 1
            out += taken
            num_left -= num_taken
        self.age = key
        self.num_ring_blocks -= num_victims

    def _pop_victim(self) -> KVCacheBlock:
        victims: list[KVCacheBlock] = []
        self._pop_victims(1, victims)
        return victims[0]

    def _forget(self, block: KVCacheBlock) -> None:
        block_id = block.block_id
        self._access_count[block_id] = 0
        self._gen[block_id] += 1
        self._parent_id[block_id] = -1
        self._child_key[block_id] = 0

    def _clear(self) -> None:
        super()._clear()
        self._gen = [generation + 1 for generation in self._gen]
        self._parent_id = [-1] * self.num_blocks
        self._child_key = [0] * self.num_blocks

    def _check(self) -> None:
        super()._check()
        position = {id(block): index for index, block in enumerate(super()._iter_cached())}
        for block in self.blocks:
            block_id = block.block_id
            if block.block_hash is None:
                continue  # stale state is reset when the block is cached again
            parent_id = self._parent_id[block_id]
            if parent_id < 0 or self._parent_gen[block_id] != self._gen[parent_id]:
                continue
            parent = self.blocks[parent_id]
            if id(block) in position and id(parent) in position:
                if position[id(parent)] < position[id(block)]:
                    raise InvariantViolation(
                        f"cost: parent {parent_id} would be evicted before its child {block_id}"
                    )

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        """Exact eviction order (as `lfu`)."""
        return super()._iter_cached()
