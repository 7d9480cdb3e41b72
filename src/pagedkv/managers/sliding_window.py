"""Sliding-window manager: blocks that leave the window are freed early; hits are right-to-left.

A token attends to the previous `sliding_window` tokens (itself included), so a prefix hit only
needs the last `sliding_window - 1` tokens of KV to be cached; everything before is null.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.hashing import resolve_block_hashes
from pagedkv.managers.base import SingleTypeKVCacheManager
from pagedkv.specs import KVCacheSpec, SlidingWindowSpec, cdiv

if TYPE_CHECKING:
    from pagedkv.request import Request


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding-window attention (Mistral, Gemma 2/3 local layers).

    Invariants (besides the base's): a request's null blocks form a prefix of its table (they
    stand for positions before the window); a block is nulled and freed once no future token
    can attend to it (`get_num_skipped_tokens` on the processed-token basis).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        spec = cast(SlidingWindowSpec, kv_cache_spec)
        self.sliding_window = spec.sliding_window
        # Hot path: the window's trailing edge, extended by the retained tokens, in one number.
        self._window_edge = spec.sliding_window - 1 + spec.extra_retained_tokens

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token: `n - sliding_window + 1` (sw=4, n=7 → 4),
        less the spec's `extra_retained_tokens`."""
        return max(0, num_computed_tokens - self._window_edge)

    @staticmethod
    def num_contiguous_blocks_needed(sliding_window: int, block_size: int) -> int:
        """Cached blocks a hit must end with: the KV of the last `sliding_window - 1` tokens.

        At least one, as in the reference (a window of 1 still needs a cached block to hit).
        """
        return max(cdiv(sliding_window - 1, block_size), 1)

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
        """Rightmost aligned end whose last `need` blocks are cached, else the leading run.

        Searches right to left over candidate ends `e` (in blocks, `e * block_size` a multiple
        of `alignment_tokens`): a hit needs blocks `[e - need, e)` cached in every listed group.
        A miss at block j rules out every end whose window covers j, so the search jumps to the
        first end at or below j (each block is probed at most once). With no such end, the run
        of cached blocks from block 0 (cut to the alignment) is the hit. The blocks before the
        window are the null block. With `drop_eagle_block` a hit needs one block more, ending
        one block past an aligned end, and that block is dropped again.
        """
        spec = cast(SlidingWindowSpec, kv_cache_spec)
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        shift = 1 if drop_eagle_block else 0
        need = cls.num_contiguous_blocks_needed(spec.sliding_window, block_size) + shift
        step = alignment_tokens // block_size
        max_num_blocks = min(max_length // block_size, len(hashes))
        num_groups = len(kv_cache_group_ids)
        if num_groups == 1:
            get = block_pool.hash_to_block[kv_cache_group_ids[0]].get

            def probe(block_hash: BlockHash) -> list[KVCacheBlock] | None:
                block = get(block_hash)
                return None if block is None else [block]

        else:

            def probe(block_hash: BlockHash) -> list[KVCacheBlock] | None:
                return block_pool.get_cached_block(block_hash, kv_cache_group_ids)

        # Candidate ends e satisfy (e - shift) % step == 0.
        end = (max_num_blocks - shift) // step * step + shift if max_num_blocks >= shift else -1
        while end >= need:
            # Probe the window right to left; remember what we found for the result.
            window: list[list[KVCacheBlock]] = []
            miss_at = -1
            for index in range(end - 1, end - need - 1, -1):
                found = probe(hashes[index])
                if found is None:
                    miss_at = index
                    break
                window.append(found)
            if miss_at < 0:
                window.reverse()
                del window[len(window) - shift :]  # the EAGLE block
                null_block = block_pool.null_block
                num_null = end - need
                computed = tuple(
                    [null_block] * num_null + [blocks[g] for blocks in window]
                    for g in range(num_groups)
                )
                return computed, (end - shift) * block_size
            end = (miss_at - shift) // step * step + shift if miss_at >= shift else -1
        # No full window: the cached run from block 0 is a hit on its own (shorter than need).
        leading: list[list[KVCacheBlock]] = []
        for index in range(min(max_num_blocks, need + step)):
            found = probe(hashes[index])
            if found is None:
                break
            leading.append(found)
        num_hit_blocks = cls._leading_hit_blocks(len(leading), step, drop_eagle_block)
        computed = tuple(
            [blocks[g] for blocks in leading[:num_hit_blocks]] for g in range(num_groups)
        )
        return computed, num_hit_blocks * block_size

    @staticmethod
    def _leading_hit_blocks(num_leading: int, step: int, drop_eagle_block: bool) -> int:
        """Blocks of a leading run of `num_leading` cached blocks that make a hit.

        Aligned down to `step`; with EAGLE the run must end one block past an aligned end
        (its top at a multiple of `step`), is aligned, loses one block and is aligned again.
        """
        if not drop_eagle_block:
            return num_leading // step * step
        if num_leading == 0:
            return 0
        num_blocks = ((num_leading - 1) // step * step + 1) // step * step
        if num_blocks == 0:
            return 0
        return (num_blocks - 1) // step * step

    def reachable_block_mask(
        self,
        request: Request,
        start_block: int,
        end_block: int,
        replay_boundaries: Sequence[int],
    ) -> list[bool] | None:
        """Blocks a later hit can use, when hits land on boundaries wider than the window.

        A hit at an aligned boundary needs only the `need` blocks before it (one more, past
        it, with EAGLE). Dense segments are `alignment_tokens` wide; with a retention interval
        N > 0 they are N tokens wide, with 0 there are none. With any interval the tails at the
        replay boundaries and the request's shared-prefix boundary are kept too. None (cache
        all) when every block is reachable anyway.
        """
        alignment_tokens = self.alignment_tokens
        block_size = self.block_size
        interval = self.retention_interval
        if alignment_tokens % block_size:
            return None
        shift = 1 if self.use_eagle else 0
        need = cdiv(self.sliding_window - 1, block_size) + shift
        segment_tokens = alignment_tokens if interval is None else interval
        if segment_tokens and need >= segment_tokens // block_size:
            return None
        mask = [False] * (end_block - start_block)
        if segment_tokens:
            per_segment = segment_tokens // block_size
            first_kept = per_segment - need
            for index in range(max(start_block, shift), end_block):
                if (index - shift) % per_segment >= first_kept:
                    mask[index - start_block] = True
        if interval is not None:
            boundaries = list(replay_boundaries)
            junction = request.shared_prefix_boundary
            if junction:
                boundaries.append(junction)
                if self.use_eagle:
                    boundaries.append(junction - block_size)
            for boundary in boundaries:
                end = boundary // alignment_tokens * alignment_tokens // block_size + shift
                for index in range(max(start_block, end - need), min(end_block, end)):
                    mask[index - start_block] = True
        return mask
