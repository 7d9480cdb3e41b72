"""Block pool layer, KV events: the `BlockStored` event of a `BlockPool.cache_full_blocks` or
`cache_partial_block` call.

Pure functions of what the pool passes in (the request, the positions stored, the pool's medium
and hash lookahead); they change nothing. Knows no pool, no eviction policy, no request class.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.events import BlockStored
from pagedkv.eviction import RetentionLevels
from pagedkv.hashing import HashedRequest, generate_block_hash_extra_keys, to_event_extra_keys

if TYPE_CHECKING:
    from pagedkv.request import Request


def stored_block_positions(
    new_blocks: Sequence[KVCacheBlock],
    new_block_hashes: Sequence[BlockHash],
    skipped: Sequence[KVCacheBlock],
    num_cached_blocks: int,
) -> tuple[list[BlockHash], list[int]]:
    """The hashes and request positions of the new blocks that were stored (not `skipped`).

    `new_blocks[i]` sits at position `num_cached_blocks + i` of the request; `skipped` are the
    null, masked or already-hashed ones among them, which the event leaves out.
    """
    skipped_ids = {id(block) for block in skipped}
    new_hashes: list[BlockHash] = []
    new_indices: list[int] = []
    for index, (block, block_hash) in enumerate(
        zip(new_blocks, new_block_hashes, strict=False), num_cached_blocks
    ):
        if id(block) not in skipped_ids:
            new_hashes.append(block_hash)
            new_indices.append(index)
    return new_hashes, new_indices


def block_stored_event(
    request: Request,
    block_hashes: Sequence[BlockHash],
    new_blocks: Sequence[KVCacheBlock],
    new_block_hashes: Sequence[BlockHash],
    skipped: Sequence[KVCacheBlock],
    num_cached_blocks: int,
    num_full_blocks: int,
    block_size: int,
    group_id: int,
    num_lookahead_tokens: int,
    medium: str,
    retention: RetentionLevels | None,
) -> BlockStored:
    """The event for blocks [num_cached_blocks, num_full_blocks) of `request`, whose blocks and
    hashes are `new_blocks` and `new_block_hashes`, less the `skipped` ones (null, masked or
    already hashed); one event per call even if every block was skipped (then with no hashes
    but the call's tokens), as the reference emits it. `kv_cache_spec_kind` and the sliding
    window are left for the facade's `take_events` to fill in.

    Args:
        block_hashes: the request's hashes at this group's block size (the parent comes from
            them, so a null physical parent, a block outside a sliding window, still yields the
            logical parent).
        num_lookahead_tokens: tokens after each block that its hash covers (0: none).
        retention: the pool's retention levels, which report each stored block's priority.
    """
    new_hashes: list[BlockHash]
    new_indices: Sequence[int]
    # The per-block lists are built only when blocks were skipped (rare).
    if not skipped:
        # A list slice is already a fresh list; a coarse view's slice too.
        new_hashes = new_block_hashes if type(new_block_hashes) is list else list(new_block_hashes)
        new_indices = range(num_cached_blocks, num_full_blocks)
    else:
        new_hashes, new_indices = stored_block_positions(
            new_blocks, new_block_hashes, skipped, num_cached_blocks
        )
    parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
    start_token = num_cached_blocks * block_size
    end_token = num_full_blocks * block_size
    lookahead = num_lookahead_tokens
    # One entry per stored block (None for a block without keys), None for no blocks: the
    # reference's (0.33) form.
    per_block: list[tuple | None]
    if request.has_extra_keys:
        # A Request is a HashedRequest; mypy cannot tell (the protocol's token list is
        # read-only, the class's a list), so say it once here, off the common path.
        hashed = cast(HashedRequest, request)
        per_block = []
        cursor = 0
        for index in new_indices:
            keys, cursor = generate_block_hash_extra_keys(
                hashed, index * block_size, (index + 1) * block_size + lookahead, cursor
            )
            per_block.append(to_event_extra_keys(keys))
    else:
        per_block = [None] * len(new_indices)
    extra_keys = per_block or None
    lookahead_token_ids = None
    if lookahead:
        tokens = request.all_token_ids
        lookahead_token_ids = [
            tokens[(index + 1) * block_size : (index + 1) * block_size + lookahead]
            for index in new_indices
        ]
    lora = request.lora_request
    # Hot path: positional arguments (the dataclass's field order) halve the cost of the
    # keyword form; kv_cache_spec_kind and _sliding_window are filled by take_events.
    event = BlockStored(
        new_hashes,  # type: ignore[arg-type]  # BlockHash is bytes; a cast would cost a call
        parent,
        request.all_token_ids[start_token:end_token],
        block_size,
        lora.adapter_id if lora is not None else None,
        medium,
        lora.name if lora is not None else None,
        extra_keys,
        group_id,
        None,
        None,
        None,
        None,
        request.session_id,
        lookahead_token_ids,
    )
    if retention is not None:
        priority_of = retention.priority_of
        event.retention_priorities = [
            priority_of(new_blocks[index - num_cached_blocks]) for index in new_indices
        ]
    return event


def partial_block_stored_event(
    request: Request,
    block: KVCacheBlock,
    num_hash_blocks: int,
    hash_block_size: int,
    group_id: int,
    num_lookahead_tokens: int,
    medium: str,
) -> BlockStored:
    """The event of a sub-block entry of `block` at `num_hash_blocks * hash_block_size` tokens:
    the hash block ending there, as one stored block of `hash_block_size` tokens (the
    reference's form)."""
    block_hashes = request.block_hashes
    return block_stored_event(
        request,
        block_hashes,
        [block],
        block_hashes[num_hash_blocks - 1 : num_hash_blocks],
        (),
        num_hash_blocks - 1,
        num_hash_blocks,
        hash_block_size,
        group_id,
        num_lookahead_tokens,
        medium,
        None,
    )
