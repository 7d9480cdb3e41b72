"""Leaf: KV-cache events as plain data (their wire encoding lives in `pagedkv.wire`).

Field names and order follow the reference's `BlockStored`, `BlockRemoved` and
`AllBlocksCleared`, so a consumer written against vLLM reads them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.block import ExternalBlockHash

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(slots=True)
class BlockStored:
    """Blocks newly entered into the prefix cache, for one group, in chain order."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    session_id: str | None = None
    # Retention priority of each block (pagedkv.retention; None unless the pool honours
    # retention hints). In process only: the reference's wire schema has no such field.
    retention_priorities: list[int] | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Prefix-cache entries dropped (evicted on reuse, or by `evict_blocks`)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
