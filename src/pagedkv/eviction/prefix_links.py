"""Eviction layer: which cached block each cached block extends (its prefix-chain parent).

A block's parent is the block before it in the table that cached it (the physical parent), so
keeping a parent while any cached child remains keeps every hash chain hittable. Knows nothing
of policies; the `cost` and `belady` policies use it to evict leaves only.
"""

from __future__ import annotations

from pagedkv.block import KVCacheBlock
from pagedkv.errors import InvariantViolation


class PrefixLinks:
    """Parent links and cached-child counts, by block id.

    Invariants: `num_children[p]` counts the cached blocks whose live link names p; a link is
    live while the parent keeps the cache identity it had when the child was cached (its
    generation `gen[p]` is unchanged); a block that leaves the cache has no children and no
    parent, and its generation moves on, so stale links from old children are ignored.
    """

    __slots__ = ("parent_id", "parent_gen", "gen", "num_children")

    def __init__(self, num_blocks: int) -> None:
        self.parent_id = [-1] * num_blocks
        self.parent_gen = [0] * num_blocks
        self.gen = [0] * num_blocks
        self.num_children = [0] * num_blocks

    def link(self, block: KVCacheBlock, parent: KVCacheBlock | None) -> None:
        """`block` was just cached after `parent` (None, the null block or an uncached block:
        no parent)."""
        block_id = block.block_id
        if (
            parent is None
            or parent.block_hash is None
            or parent.hash_group_id != block.hash_group_id
        ):
            self.parent_id[block_id] = -1
            return
        parent_id = parent.block_id
        self.parent_id[block_id] = parent_id
        self.parent_gen[block_id] = self.gen[parent_id]
        self.num_children[parent_id] += 1

    def unlink(self, block: KVCacheBlock) -> int:
        """`block` leaves the cache; return its parent's id if that parent just became a leaf."""
        block_id = block.block_id
        self.gen[block_id] += 1
        self.num_children[block_id] = 0
        parent_id = self.parent_id[block_id]
        if parent_id < 0:
            return -1
        self.parent_id[block_id] = -1
        if self.parent_gen[block_id] != self.gen[parent_id]:
            return -1  # the parent left the cache before this child
        num_children = self.num_children[parent_id] - 1
        self.num_children[parent_id] = num_children
        return parent_id if num_children == 0 else -1

    def is_leaf(self, block: KVCacheBlock) -> bool:
        return self.num_children[block.block_id] == 0

    def clear(self) -> None:
        """Every block left the cache."""
        num_blocks = len(self.gen)
        self.gen = [generation + 1 for generation in self.gen]
        self.parent_id = [-1] * num_blocks
        self.num_children = [0] * num_blocks

    def check_invariants(self, blocks: list[KVCacheBlock]) -> None:
        """Recount every live link from the cached blocks."""
        counted = [0] * len(blocks)
        for block in blocks:
            block_id = block.block_id
            parent_id = self.parent_id[block_id]
            if block.block_hash is None:
                if parent_id >= 0 or self.num_children[block_id]:
                    raise InvariantViolation(f"uncached block {block_id} keeps prefix links")
                continue
            if parent_id >= 0 and self.parent_gen[block_id] == self.gen[parent_id]:
                if blocks[parent_id].block_hash is None:
                    raise InvariantViolation(f"block {block_id}'s live parent is uncached")
                counted[parent_id] += 1
        if counted != self.num_children:
            raise InvariantViolation("prefix links: child counts differ from the live links")
