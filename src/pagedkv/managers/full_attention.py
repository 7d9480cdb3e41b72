"""Full-attention manager: every block stays until the request ends; hits are left-to-right."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from itertools import islice, takewhile
from operator import is_not
from typing import cast

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.hashing import resolve_block_hashes
from pagedkv.managers.base import SingleTypeKVCacheManager
from pagedkv.specs import KVCacheSpec, cdiv

_is_block = partial(is_not, None)  # a C-level "found" test for dict.get results


def _extend_into_block(
    computed: tuple[list[KVCacheBlock], ...],
    block_hashes: Sequence[BlockHash],
    max_length: int,
    kv_cache_group_ids: Sequence[int],
    block_pool: BlockPool,
    hash_block_size: int,
    block_size: int,
    hit_length: int,
) -> int:
    """Phase two of a sub-block lookup: probe the hash boundaries inside the first block not
    cached whole, longest first; a hit appends that block and returns its length."""
    scale = block_size // hash_block_size
    first = len(computed[0]) * scale
    end = min(first + scale - 1, max_length // hash_block_size, len(block_hashes))
    for index in range(end - 1, first - 1, -1):
        cached = block_pool.get_cached_block(block_hashes[index], kv_cache_group_ids)
        if cached is None:
            continue
        for group_hits, block in zip(computed, cached, strict=True):
            group_hits.append(block)
        return (index + 1) * hash_block_size
    return hit_length


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full (and MLA) attention. Hits are downward closed: any prefix of a hit is a hit.

    With `alignment_tokens` below the block size (sub-block hits, which the hybrid coordinator
    enables for Mamba "align" models), a hit may also end at a hash boundary inside the first
    block that is not cached whole, where a sub-block entry of the prompt's tail was entered.
    """

    supports_fine_grained_hash_lookup = True

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
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size)
        max_num_blocks = min(max_length // block_size, len(hashes))
        if len(kv_cache_group_ids) == 1:
            # Hot path: one dict probe per block, no per-block list of groups.
            hits: list[KVCacheBlock] = []
            get = block_pool.hash_to_block[kv_cache_group_ids[0]].get
            for index in range(max_num_blocks):
                block = get(hashes[index])
                if block is None:
                    break  # chained hashes: every later block misses too
                hits.append(block)
            computed: tuple[list[KVCacheBlock], ...] = (hits,)
        else:
            computed = tuple([] for _ in kv_cache_group_ids)
            for index in range(max_num_blocks):
                cached = block_pool.get_cached_block(hashes[index], kv_cache_group_ids)
                if cached is None:
                    break
                for group_hits, block in zip(computed, cached, strict=True):
                    group_hits.append(block)
        hit_length = len(computed[0]) * block_size
        if alignment_tokens < block_size and block_size % alignment_tokens == 0:
            hit_length = _extend_into_block(
                computed,
                block_hashes,
                max_length,
                kv_cache_group_ids,
                block_pool,
                alignment_tokens,
                block_size,
                hit_length,
            )
        if drop_eagle_block and hit_length:
            # EAGLE recomputes the tokens just before the generation point: drop a hash block
            # below a block (the tail block's KV is append-only, so it still covers the rest),
            # else a block.
            hit_length -= min(alignment_tokens, block_size)
        if hit_length % alignment_tokens:
            hit_length -= hit_length % alignment_tokens
        num_kept = cdiv(hit_length, block_size)
        if num_kept < len(computed[0]):
            for group_hits in computed:
                del group_hits[num_kept:]
        return computed, hit_length

    def prefill_and_free(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> int | None:
        """Serve a prompt as a request that holds no blocks and finishes at once.

        The same pool calls, in the same order and with the same arguments, as the facade's
        `get_computed_blocks`, `allocate_slots(request, num_tokens - hit, hit, hit_blocks,
        has_scheduled_reqs=False)` and `free` of such a request, with no table entry in
        between. The caller has checked the arguments (at least `num_tokens // block_size`
        hashes when caching).

        Returns the hit length in tokens, or None if the prompt does not fit (nothing changed).
        """
        block_size = self.block_size
        pool = self.block_pool
        hits: list[KVCacheBlock] = []
        if self.enable_caching:
            get: Callable[[BlockHash], KVCacheBlock | None]
            get = pool.hash_to_block[self.kv_cache_group_id].get
            num_probes = min((num_tokens - 1) // block_size, len(block_hashes))
            # Hot path: probe in C until the first miss (chained hashes: every later block
            # misses too); takewhile drops the None that stops it.
            found = takewhile(_is_block, map(get, islice(block_hashes, num_probes)))
            hits = cast(list[KVCacheBlock], list(found))
        num_hits = len(hits)
        num_blocks = -(-num_tokens // block_size)
        num_free = pool.free_block_queue.num_free_blocks
        if num_blocks > num_free:
            # Hit blocks nobody holds sit in the free queue: adopting them uses free blocks.
            # (With num_blocks free blocks the prompt fits whatever they are.)
            num_evictable = 0
            for block in hits:
                if block.ref_cnt == 0:
                    num_evictable += 1
            if num_blocks - num_hits + num_evictable > num_free:
                return None
        pool.touch(hits)
        blocks = hits
        blocks += pool.get_new_blocks(num_blocks - num_hits)
        if self.enable_caching:
            pool.cache_full_blocks(
                None,
                blocks,
                block_hashes,
                num_hits,
                num_tokens // block_size,
                block_size,
                self.kv_cache_group_id,
            )
        blocks.reverse()  # as `free`: the prompt's tail is evicted before its head
        pool.free_blocks(blocks)
        return num_hits * block_size

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        blocks = self.req_to_blocks.get(running_request_id)
        if not blocks:
            return 0
        num_holders = len(self.req_to_blocks)
        count = 0
        for block in blocks:
            if block.ref_cnt != num_holders:
                break
            count += 1
        return count
