"""Mamba / SSM manager: a request needs only its latest state block; earlier states are freed
(and stay prefix-cached) once processed. A cached state is reusable only at its exact boundary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.hashing import resolve_block_hashes
from pagedkv.managers.base import SingleTypeKVCacheManager
from pagedkv.specs import KVCacheSpec

if TYPE_CHECKING:
    from pagedkv.request import Request


class MambaManager(SingleTypeKVCacheManager):
    """Mamba state blocks, one per block position.

    The block at position j holds the state after the `(j + 1) * block_size` tokens up to its
    end (the model writes the state at every block boundary a step crosses; the last block of a
    step holds the state after the step's last token and is completed in place later). So a
    full block is a valid prefix-cache entry, cached like an attention block. A request needs
    only the state after its last computed token: `get_num_skipped_tokens(n) = n - 1`, so once
    processed every earlier block is nulled and freed (still cached), leaving the latest state
    block plus the blocks of the step being computed. For caching off, give the spec a
    `block_size` of `max_model_len`: then a request holds exactly one state block.

    Prefix hits: the rightmost state cached at an aligned boundary `<= max_length` wins, as
    `[null] * i + [state]`, `(i + 1) * block_size` tokens. A block cached in the current step
    (since the last `new_step_starts`) is a miss: blocks are cached when the step is scheduled,
    and the state is written only when it runs, too late for another request of the same step.

    Not supported (the reference's "align" mode): states only at scheduled-chunk ends,
    speculative-decoding state blocks and their relocation, prefill checkpoints, copy-on-write
    of partial-tail states; lookahead (draft) tokens are not rolled back.

    Invariant (besides the base's): `block_ids_cached_this_step` lists blocks this manager
    hashed since the last `new_step_starts`.
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        # A set object that the hybrid coordinator shares between Mamba groups looked up
        # together, so one group's fresh state makes the whole bucket miss.
        self.block_ids_cached_this_step: set[int] = set()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """All but the last token: only the state after it is needed."""
        return max(0, num_computed_tokens - 1)

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache full state blocks up to `num_tokens`, remembering them for the same-step rule."""
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_cached:
            return
        null_block = self._null_block
        fresh = [
            block
            for block in self.req_to_blocks[request_id][num_cached:num_full]
            if block is not null_block and block.block_hash is None
        ]
        super().cache_blocks(request, num_tokens)
        self.block_ids_cached_this_step.update(block.block_id for block in fresh)

    # An instance method, unlike the base's classmethod: the same-step rule needs this
    # manager's record of the blocks cached in the current step. Coordinators call it on the
    # manager instance.
    def find_longest_cache_hit(  # type: ignore[override]
        self,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The rightmost state cached at an aligned boundary `<= max_length`, in every group."""
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        step = alignment_tokens // block_size
        max_num_blocks = min(max_length // block_size, len(hashes))
        cached_this_step = self.block_ids_cached_this_step
        null_block = block_pool.null_block
        for end in range(max_num_blocks // step * step, 0, -step):
            cached = block_pool.get_cached_block(hashes[end - 1], kv_cache_group_ids)
            if cached is None:
                continue
            # Lookups return the first block cached under a hash; if that one is from this
            # step, so is every duplicate, and the state is not written yet.
            if cached_this_step and any(b.block_id in cached_this_step for b in cached):
                continue
            return tuple([null_block] * (end - 1) + [block] for block in cached), end * block_size
        return tuple([] for _ in kv_cache_group_ids), 0

    def new_step_starts(self) -> None:
        self.block_ids_cached_this_step.clear()
