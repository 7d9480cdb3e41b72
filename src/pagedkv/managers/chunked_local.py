"""Chunked-local manager (Llama 4): a token attends only within its `attention_chunk_size` chunk,
so blocks of earlier chunks are freed early and count as computed in a prefix hit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.hashing import resolve_block_hashes
from pagedkv.managers.base import SingleTypeKVCacheManager
from pagedkv.specs import ChunkedLocalAttentionSpec, KVCacheSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    """Chunked local attention.

    Invariants (besides the base's): a request's null blocks form a prefix of its table; a block
    is nulled and freed once it lies wholly before the chunk of the next token to compute.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.attention_chunk_size = cast(
            ChunkedLocalAttentionSpec, kv_cache_spec
        ).attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens of the chunks before the next token's: `n // chunk * chunk` (chunk 8: 13 → 8)."""
        chunk = self.attention_chunk_size
        return num_computed_tokens // chunk * chunk

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        drop_eagle_block: bool = False,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Null blocks up to the chunk of `max_length`, then cached blocks left to right.

        Blocks wholly before the chunk containing position `max_length` are not needed, so they
        count as computed (the null block) even if nothing is cached. The hit is then cut to
        `alignment_tokens`; if that cut lands in an earlier chunk (or the chunk size is not a
        multiple of the block size and no block of the chunk is cached), the hit would need
        blocks of that chunk, so the search restarts there with the shorter length.
        """
        chunk = cast(ChunkedLocalAttentionSpec, kv_cache_spec).attention_chunk_size
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        num_groups = len(kv_cache_group_ids)
        while True:
            first = max_length // chunk * chunk // block_size  # first block the hit needs
            end = min(max_length // block_size, len(hashes))
            found: list[list[KVCacheBlock]] = []
            for index in range(first, end):
                cached = block_pool.get_cached_block(hashes[index], kv_cache_group_ids)
                if cached is None:
                    break  # chained hashes: every later block misses too
                found.append(cached)
            hit_length = (first + len(found)) * block_size
            hit_length = hit_length // alignment_tokens * alignment_tokens
            if hit_length // chunk * chunk // block_size >= first:
                num_found = hit_length // block_size - first
                null_block = block_pool.null_block
                computed = tuple(
                    [null_block] * first + [blocks[g] for blocks in found[:num_found]]
                    for g in range(num_groups)
                )
                return computed, hit_length
            max_length = hit_length  # strictly shorter: the loop ends
