"""Circular-buffer manager: one scratch block per request (vLLM 0.33's `CircularBufferManager`).

A compressor's ring (DeepSeek-V4's CSA, GLM-5's indexer tail) holds the raw keys of the token
group still being compressed: the request claims one block when it is first allocated and keeps
it until it is freed, whatever its length. Never prefix-cached, never a hit, nothing skipped.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.managers.base import EMPTY_BLOCK_LIST, SingleTypeKVCacheManager
from pagedkv.specs import KVCacheSpec


class CircularBufferManager(SingleTypeKVCacheManager):
    """Invariant: a request's table is empty or exactly one block, held from its first
    allocation to its free."""

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
        num_local_computed_tokens: int = 0,
    ) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Nothing to adopt: a hit never covers the ring (its block is claimed with the rest)."""

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        self._claim_ring_block(request_id, record_for_zeroing)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        return self._claim_ring_block(request_id)

    def _claim_ring_block(
        self, request_id: str, record_for_zeroing: bool = True
    ) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        if req_blocks:
            return EMPTY_BLOCK_LIST
        new_blocks = self.block_pool.get_new_blocks(1)
        req_blocks.extend(new_blocks)
        if record_for_zeroing and self.new_block_ids is not None:
            self.new_block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

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
        return tuple([] for _ in kv_cache_group_ids), 0

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """The ring is held whole until the request is freed."""
