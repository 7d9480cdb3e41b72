"""Leaf: the KV-cache block and the hash key types.

A block is one page of KV memory. Blocks are compared by identity; the pool owns all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NewType

BlockHash = NewType("BlockHash", bytes)
"""Chained hash of a full block of tokens (and every token before it)."""

BlockHashWithGroupId = NewType("BlockHashWithGroupId", bytes)
"""`BlockHash` plus a 4-byte big-endian group id: the reference's cache key, used on the wire."""

ExternalBlockHash = bytes | int
"""How events carry a block hash: raw digest bytes, or the low 64 bits as an int."""


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    """Append the group id (4 bytes, big-endian) to a block hash, as the reference keys its map."""
    return BlockHashWithGroupId(block_hash + group_id.to_bytes(4, "big"))


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    """Strip the group id from a reference-style cache key."""
    return BlockHash(key[:-4])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """Read the group id of a reference-style cache key."""
    return int.from_bytes(key[-4:], "big")


def to_external_hash(block_hash: bytes, use_int: bool = True) -> ExternalBlockHash:
    """Convert a hash for events: its low 64 bits as an int (reference default), or the bytes."""
    if use_int:
        return int.from_bytes(block_hash, "big") & 0xFFFF_FFFF_FFFF_FFFF
    return bytes(block_hash)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One KV-cache block.

    Invariants (kept by `BlockPool`): `ref_cnt` counts the block tables holding the block; the
    block is linked in the free queue iff `ref_cnt == 0` and it is not the null block;
    `block_hash` is set iff the block is in the prefix cache, under `hash_group_id`, and then
    `hash_num_tokens` is the prefix length that hash covers: the end of the block for a full
    block, a hash-block boundary inside it for a sub-block (partial) entry. A block may be
    reachable under further keys too (the pool's `extra_block_hashes`).

    Seven slots on purpose: with the block id object and the pool's list slot it takes 128
    bytes a block (measured by benchmarks/bench_memory.py).
    """

    block_id: int
    ref_cnt: int = 0
    # Hot path: the raw chained hash (not hash+group bytes), so lookups never build a key.
    block_hash: BlockHash | None = None
    # The group whose hash map holds this block; meaningful only while block_hash is set.
    hash_group_id: int = 0
    # Tokens the primary hash covers; meaningful only while block_hash is set (so freeing or
    # evicting never has to reset it).
    hash_num_tokens: int = 0
    # Intrusive free-queue links; None when the block is not linked.
    prev_free_block: KVCacheBlock | None = None
    next_free_block: KVCacheBlock | None = None

    @property
    def is_null(self) -> bool:
        """Whether this is the pool's null block (block 0), the placeholder for skipped slots."""
        return self.block_id == 0

    @property
    def _block_hash(self) -> BlockHash | None:
        """The reference's private name of `block_hash` (its own scheduler tests read it)."""
        return self.block_hash

    @property
    def block_hash_num_tokens(self) -> int | None:
        """vLLM 0.33's name: the prefix tokens the block's hash covers (None if unhashed)."""
        return self.hash_num_tokens if self.block_hash is not None else None

    def reset_hash(self) -> None:
        """Forget the block's prefix-cache identity (the pool removes the map entry itself)."""
        self.block_hash = None
        self.hash_group_id = 0

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block else None
        next_id = self.next_free_block.block_id if self.next_free_block else None
        hash_hex = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"block_hash={hash_hex}, group={self.hash_group_id}, "
            f"prev_free={prev_id}, next_free={next_id})"
        )
