"""Mamba / SSM managers, one class per cache mode of the reference (`MambaSpec.mamba_cache_mode`).

A Mamba layer needs only the state after a request's last computed token. "none": no prefix
caching; a request holds one state block (the spec's block size is `max_model_len`) plus its
speculative blocks. "align" (`mamba_align.py`): states at block boundaries are prefix-cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.errors import ConfigError
from pagedkv.hashing import resolve_block_hashes
from pagedkv.managers.base import SingleTypeKVCacheManager
from pagedkv.specs import KVCacheSpec, MambaSpec, cdiv

if TYPE_CHECKING:
    pass


def prefill_checkpoint_position(
    num_tokens: int, hash_block_size: int, drop_eagle_block: bool, num_hash_lookahead_tokens: int
) -> int:
    """The reusable state boundary of a prefill of `num_tokens` (vLLM 0.33's rule).

    Leaves a token to recompute for the logits and the lookahead tokens the boundary's hash
    covers; with EAGLE, one more hash unit (its hits drop one).
    """
    if drop_eagle_block:
        position = num_tokens // hash_block_size * hash_block_size - hash_block_size
    else:
        proof_limit = num_tokens - max(1, num_hash_lookahead_tokens)
        position = proof_limit // hash_block_size * hash_block_size
    return max(position, 0)


def is_prefill_checkpoint_valid(
    query_start: int,
    query_end: int,
    checkpoint_position: int,
    hash_block_size: int,
    block_size: int,
    checkpoint_alignment: int | None,
) -> bool:
    """Whether the worker can export the state at `checkpoint_position` in this chunk."""
    if checkpoint_alignment is None:
        return False
    initial_state_col = (query_start - 1) // block_size
    checkpoint_col = cdiv(query_end, block_size) - 2
    return (
        query_start % hash_block_size == 0
        and checkpoint_col > initial_state_col
        and query_start + hash_block_size <= checkpoint_position
        and query_start < checkpoint_position < query_end
        and (checkpoint_position - query_start) % checkpoint_alignment == 0
    )


class MambaManager(SingleTypeKVCacheManager):
    """What both Mamba modes share: only the state after the last computed token is needed,
    and a hit is the rightmost state cached at an aligned boundary (no EAGLE drop: draft
    models have no Mamba layers). `manager_class_for` picks a subclass by the spec's mode.
    """

    supports_fine_grained_hash_lookup = True

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        self.num_speculative_blocks = cast(MambaSpec, kv_cache_spec).num_speculative_blocks

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """All but the last token: only the state after it is needed."""
        return max(0, num_computed_tokens - 1)

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
        """The rightmost state cached at an aligned boundary `<= max_length`, in every group.

        Returns `[null] * i + [state]` per group and `(i + 1) * block_size` tokens. With
        `alignment_tokens` below the block size (sub-block hits) every hash boundary is a
        candidate: a state at `n` tokens sits at position `(n - 1) // block_size`.
        """
        block_size = kv_cache_spec.block_size
        null_block = block_pool.null_block
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            hash_block_size = alignment_tokens
            for index in range(min(max_length // hash_block_size, len(block_hashes)) - 1, -1, -1):
                cached = block_pool.get_cached_block(block_hashes[index], kv_cache_group_ids)
                if cached is None:
                    continue
                position = index * hash_block_size // block_size
                num_tokens = (index + 1) * hash_block_size
                return tuple([null_block] * position + [block] for block in cached), num_tokens
            return tuple([] for _ in kv_cache_group_ids), 0
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        for index in range(min(max_length // block_size, len(hashes)) - 1, -1, -1):
            cached = block_pool.get_cached_block(hashes[index], kv_cache_group_ids)
            if cached is None or (index + 1) * block_size % alignment_tokens:
                continue
            num_tokens = (index + 1) * block_size
            return tuple([null_block] * index + [block] for block in cached), num_tokens
        return tuple([] for _ in kv_cache_group_ids), 0


class MambaNoCacheManager(MambaManager):
    """Mamba in cache mode "none": one state block a request (plus speculative blocks).

    The base's block arithmetic with `num_speculative_blocks` blocks' worth of tokens added;
    with the reference's block size of `max_model_len` a request holds exactly
    `1 + num_speculative_blocks` blocks from admission to the end. Never prefix-cached (a
    `ConfigError` if caching is asked for).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        if self.enable_caching:
            raise ConfigError(
                f"group {self.kv_cache_group_id}: Mamba prefix caching needs "
                "mamba_cache_mode='align' (mode 'none' keeps no past states)"
            )

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
        num_tokens += self.block_size * self.num_speculative_blocks
        return super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, apply_admission_cap
        )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        return super().allocate_new_blocks(
            request_id, num_tokens + self.block_size * self.num_speculative_blocks
        )
