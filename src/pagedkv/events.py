"""Leaf: KV-cache events as plain data (their wire encoding lives in `pagedkv.wire`).

Field names and order follow the reference's (vLLM 0.33) `BlockStored`, `BlockRemoved` and
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
    # LOCAL or REMOTE relative to the publisher, and the offloading tier that made the event
    # (None: unspecified). pagedkv never sets them; decoded events keep them.
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # With hash lookahead, the tokens after each block that its hash covers (one list per
    # block hash); None when lookahead hashing is off.
    lookahead_token_ids: list[list[int]] | None = None
    # Retention priority of each block (pagedkv.retention; None unless the pool honours
    # retention hints). In process only: the reference's wire schema has no such field.
    retention_priorities: list[int] | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Prefix-cache entries dropped (evicted on reuse, or by `evict_blocks`)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
