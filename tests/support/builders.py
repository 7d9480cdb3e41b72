"""Shared builders and read helpers for the core tests (not a test module).

Everything here goes through the public API; `snapshot` reads every observable structure so a
test can prove a failed call left state exactly as it was.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)


def full_config(num_blocks: int, block_size: int = 16) -> KVCacheConfig:
    """One full-attention group of `num_blocks` blocks."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=1)
    return KVCacheConfig(num_blocks, (KVCacheGroupSpec(("layer.0",), spec),))


def make_manager(
    num_blocks: int = 11,
    block_size: int = 16,
    max_model_len: int = 8192,
    **kwargs,
) -> KVCacheManager:
    return KVCacheManager(full_config(num_blocks, block_size), max_model_len, **kwargs)


_HASHERS: dict[tuple[int, str], object] = {}


def hasher_for(block_size: int = 16, algorithm: str = "sha256"):
    key = (block_size, algorithm)
    if key not in _HASHERS:
        _HASHERS[key] = make_request_block_hasher(block_size, algorithm)
    return _HASHERS[key]


def make_request(
    request_id: str,
    token_ids: Sequence[int],
    block_size: int = 16,
    *,
    hashed: bool = True,
    **kwargs,
) -> Request:
    return Request(
        request_id,
        token_ids,
        block_hasher=hasher_for(block_size) if hashed else None,
        **kwargs,
    )


def free_ids(manager: KVCacheManager) -> list[int]:
    return manager.block_pool.free_block_ids()


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """Look up the request's prefix and allocate the rest of its prompt (one scheduler step).

    Returns (new_block_ids of group 0 or None, num_hit_tokens). Advances `num_computed_tokens`
    as the scheduler would after the step ran.
    """
    hits, num_hit_tokens, _ = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hits)
    if new_blocks is None:
        return None, num_hit_tokens
    request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return new_blocks.get_block_ids()[0], num_hit_tokens


def snapshot(manager: KVCacheManager) -> dict:
    """Every observable piece of state of the manager, as plain comparable data."""
    pool = manager.block_pool
    managers = manager.coordinator.single_type_managers
    return {
        "free": pool.free_block_ids(),
        "num_free": pool.get_num_free_blocks(),
        "blocks": [(b.block_id, b.ref_cnt, b.block_hash, b.hash_group_id) for b in pool.blocks],
        "cached": [pool.cached_hashes(g) for g in range(len(pool.hash_to_block))],
        "tables": [
            {rid: [b.block_id for b in blocks] for rid, blocks in m.req_to_blocks.items()}
            for m in managers
        ],
        "num_cached_block": [dict(m.num_cached_block) for m in managers],
        "events": copy.deepcopy(pool.kv_event_queue),
        "stats": copy.deepcopy(manager.prefix_cache_stats),
        "requests": dict(manager._requests),
    }
