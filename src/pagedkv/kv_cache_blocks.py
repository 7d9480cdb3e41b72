"""Result types of the facade: blocks per group, lookup results, batched decode results.

Leaf-level data holders (they import only `block`); the facade builds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from pagedkv.block import KVCacheBlock
from pagedkv.errors import GroupIndexError, InvalidArgumentError

if TYPE_CHECKING:
    from pagedkv.request import Request


@dataclass
class KVCacheBlocks:
    """Blocks per KV-cache group: `blocks[g][j]` is the j-th block of group g."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(
            tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks, strict=True))
        )

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """Block ids per group (optionally selected and reordered by `group_ids`)."""
        if group_ids is None and len(self.blocks) == 1:
            # Hot path: vLLM's scheduler converts every scheduled request's new blocks, most
            # of them empty in a decode step; one group needs no generator pass.
            (blocks,) = self.blocks
            if allow_none and not blocks:
                return None
            return ([block.block_id for block in blocks],)
        if group_ids is None:
            selected = self.blocks
        else:
            for group_id in group_ids:
                if type(group_id) is not int or not 0 <= group_id < len(self.blocks):
                    raise GroupIndexError(
                        f"group index {group_id} is out of range for {len(self.blocks)} groups"
                    )
            selected = tuple(self.blocks[group_id] for group_id in group_ids)
        if allow_none and all(not blocks for blocks in selected):
            return None
        return tuple([block.block_id for block in blocks] for blocks in selected)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of blocks not yet in the prefix cache (exactly one group)."""
        if len(self.blocks) != 1:
            raise InvalidArgumentError(
                f"get_unhashed_block_ids needs exactly one group, there are {len(self.blocks)}"
            )
        return [block.block_id for block in self.blocks[0] if block.block_hash is None]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [
            [b.block_id for b in blocks if b.block_hash is None and b.block_id != 0]
            for blocks in self.blocks
        ]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))


class DecodeSlots(NamedTuple):
    """Result of `allocate_decode_slots`."""

    num_allocated: int
    requests_with_new_blocks: list[Request]


class ComputedBlocks(NamedTuple):
    """Result of `get_computed_blocks`: hit blocks, hit tokens, shared-prefix boundary."""

    blocks: KVCacheBlocks
    num_computed_tokens: int
    shared_prefix_boundary: int


class KVCacheBlockCopy(NamedTuple):
    """One copy a sub-block hit needs before the step runs: `src_block_id`'s KV (the shared
    block the hit ends in) into `dst_block_id` (the request's private block), as vLLM 0.33."""

    src_block_id: int
    dst_block_id: int
