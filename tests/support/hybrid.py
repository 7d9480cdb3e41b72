"""Small builders shared by the hybrid and per-attention-type tests (not a test module)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVCacheSpec,
    MambaSpec,
    Request,
    SlidingWindowSpec,
    make_request_block_hasher,
)

_HASHERS: dict[int, object] = {}


def full(block_size: int) -> FullAttentionSpec:
    return FullAttentionSpec(block_size, 1, 8, 2)


def swa(block_size: int, sliding_window: int) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size, 1, 8, 2, sliding_window=sliding_window)


def chunked(block_size: int, chunk: int) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size, 1, 8, 2, attention_chunk_size=chunk)


def mamba(block_size: int, mamba_cache_mode: str = "align") -> MambaSpec:
    return MambaSpec(block_size, ((4, 8), (8, 16)), 2, mamba_cache_mode=mamba_cache_mode)


def cross(block_size: int) -> CrossAttentionSpec:
    return CrossAttentionSpec(block_size, 1, 8, 2)


def config(num_blocks: int, *specs: KVCacheSpec) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks, [KVCacheGroupSpec((f"layer{i}",), spec) for i, spec in enumerate(specs)]
    )


def make_manager(num_blocks: int, *specs: KVCacheSpec, **kwargs: object) -> KVCacheManager:
    kwargs.setdefault("max_model_len", 8192)
    return KVCacheManager(config(num_blocks, *specs), **kwargs)  # type: ignore[arg-type]


def make_request(request_id: str, token_ids: Sequence[int], hash_block_size: int) -> Request:
    hasher = _HASHERS.get(hash_block_size)
    if hasher is None:
        hasher = _HASHERS[hash_block_size] = make_request_block_hasher(hash_block_size)
    return Request(request_id, list(token_ids), block_hasher=hasher)  # type: ignore[arg-type]


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None):
    """Look the request up, adopt its hit and allocate the rest of its prompt (or a chunk).

    Returns (hit tokens, new blocks); the request's `num_computed_tokens` is advanced as if the
    step ran.
    """
    hit_blocks, num_hit_tokens, _ = manager.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit_tokens
    new_blocks = manager.allocate_slots(request, num_new_tokens, num_hit_tokens, hit_blocks)
    if new_blocks is not None:
        request.num_computed_tokens = num_hit_tokens + num_new_tokens
    return num_hit_tokens, new_blocks


def ids(blocks: Sequence) -> list[int]:
    return [block.block_id for block in blocks]
