"""Cross-attention manager (encoder-decoder models): blocks for the encoder's KV, sized by the
number of encoder tokens, allocated once and never prefix-cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.errors import ConfigError
from pagedkv.managers.base import SingleTypeKVCacheManager
from pagedkv.specs import KVCacheSpec

if TYPE_CHECKING:
    from pagedkv.request import Request

_NOT_CACHEABLE = (
    "cross-attention KV (group {group}) is never prefix-cached: it depends on the encoder "
    "input, not on the decoder prefix; build the KVCacheManager with enable_caching=False for "
    "encoder-decoder models"
)


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Cross-attention KV of the encoder output.

    The coordinator passes `num_encoder_tokens` (not the decoder's token count) as the number
    of tokens to hold: the request's blocks are allocated in the step that schedules its
    encoder input and kept until it finishes. Invariant: never a hashed block, never a hit.
    """

    supports_prefix_caching = False

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
        """Always raises `ConfigError`: cross-attention blocks are never cached."""
        raise ConfigError(_NOT_CACHEABLE.format(group=list(kv_cache_group_ids)))

    def cache_blocks(
        self, request: Request, num_tokens: int, replay_boundaries: Sequence[int] = ()
    ) -> None:
        """Always raises `ConfigError`: cross-attention blocks are never cached."""
        raise ConfigError(_NOT_CACHEABLE.format(group=self.kv_cache_group_id))

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Nothing to adopt; hit blocks are an error."""
        if new_computed_blocks:
            raise ConfigError(
                f"request {request_id!r}: {len(new_computed_blocks)} prefix-hit blocks passed "
                f"to cross-attention group {self.kv_cache_group_id}, which is never cached"
            )
        super().add_local_computed_blocks(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )
