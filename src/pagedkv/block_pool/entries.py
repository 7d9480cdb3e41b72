"""Block pool layer, cache entries: one group's hash map with duplicate hashes and blocks that are
reachable under several keys (sub-block, "partial", entries of vLLM 0.33).

A group's map holds, per hash, the first block cached under it (`hash_map`); later blocks under
the same hash wait in `duplicates[hash]` (block id -> block, in caching order). A block's first
key is its `block_hash`; a block reached from a hash-block boundary inside it as well (a partial
entry, then a full one when it fills up; or a Mamba state hit at several boundaries) keeps its
further keys in the pool's `extra_block_hashes[block_id]`, in the same group. These functions
edit those structures only; the pool sends the events and keeps the free queue.
"""

from __future__ import annotations

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.errors import InvariantViolation

HashMap = dict[BlockHash, KVCacheBlock]
Duplicates = dict[BlockHash, dict[int, KVCacheBlock]]


def drop_key(
    hash_map: HashMap, duplicates: Duplicates, block: KVCacheBlock, key: BlockHash
) -> None:
    """Remove `block` under `key` from one group's map: a primary entry hands over to the
    earliest remaining duplicate (lookups keep "first cached wins"), a duplicate just leaves.
    Raise `InvariantViolation` if the block is in neither."""
    if hash_map.get(key) is block:
        others = duplicates.get(key)
        if others:
            promoted_id = next(iter(others))
            hash_map[key] = others.pop(promoted_id)
            if not others:
                del duplicates[key]
        else:
            del hash_map[key]
        return
    others = duplicates.get(key)
    if others is None or others.pop(block.block_id, None) is None:
        raise InvariantViolation(f"block {block.block_id} has a hash but is not in the hash map")
    if not others:
        del duplicates[key]


def add_key(hash_map: HashMap, duplicates: Duplicates, block: KVCacheBlock, key: BlockHash) -> None:
    """Enter `block` under `key`: the map entry if the key is new, else a duplicate."""
    if hash_map.setdefault(key, block) is not block:
        duplicates.setdefault(key, {})[block.block_id] = block


def holds_key(extra: dict[int, list[BlockHash]], block: KVCacheBlock, key: BlockHash) -> bool:
    """Whether `block` is already reachable under `key` (its primary hash or a further key)."""
    if block.block_hash == key:
        return True
    keys = extra.get(block.block_id)
    return keys is not None and key in keys


def insert_key(
    hash_map: HashMap,
    duplicates: Duplicates,
    extra: dict[int, list[BlockHash]],
    block: KVCacheBlock,
    key: BlockHash,
    group_id: int,
    num_tokens: int,
) -> bool:
    """Make `block` reachable under `key` (the primary hash if it has none, covering
    `num_tokens`; else a further key); False if it already was."""
    if holds_key(extra, block, key):
        return False
    if block.block_hash is None:
        block.block_hash = key
        block.hash_group_id = group_id
        block.hash_num_tokens = num_tokens
    else:
        extra.setdefault(block.block_id, []).append(key)
    add_key(hash_map, duplicates, block, key)
    return True


def remove_keys(
    hash_map: HashMap,
    duplicates: Duplicates,
    extra: dict[int, list[BlockHash]],
    block: KVCacheBlock,
) -> list[BlockHash]:
    """Take `block` out of the cache under every key it has (primary first) and forget its
    hash; return the keys removed (empty if it had none)."""
    primary = block.block_hash
    if primary is None:
        return []
    keys = [primary]
    further = extra.pop(block.block_id, None)
    if further:
        keys.extend(further)
    for key in keys:
        drop_key(hash_map, duplicates, block, key)
    block.block_hash = None
    block.hash_group_id = 0
    return keys


def check_extra_keys(
    hash_maps: list[HashMap],
    duplicates: list[Duplicates],
    extra: dict[int, list[BlockHash]],
    blocks: list[KVCacheBlock],
) -> None:
    """Every further key belongs to a hashed block and reaches it in the block's group."""
    for block_id, keys in extra.items():
        block = blocks[block_id]
        if block.block_hash is None or not keys:
            raise InvariantViolation(f"block {block_id} has further keys but no primary hash")
        group = block.hash_group_id
        for key in keys:
            if key == block.block_hash:
                raise InvariantViolation(f"block {block_id} lists its primary hash again")
            if hash_maps[group].get(key) is not block and (
                duplicates[group].get(key, {}).get(block_id) is not block
            ):
                raise InvariantViolation(f"block {block_id}'s further key has no map entry")
