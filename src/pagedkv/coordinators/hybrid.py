"""Hybrid coordinator: several KV-cache groups (attention types, block sizes) with prefix caching.

Finds the longest prefix hit valid in every group and caches only whole multiples of the groups'
common block size. Chosen by `make_coordinator` for more than one group; the single-group path
never imports this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import lcm
from typing import TYPE_CHECKING

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockResidencyObserver
from pagedkv.coordinators.base import NO_SPEC_DECODE, KVCacheCoordinator
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction import EvictionConfig
from pagedkv.managers import (
    FullAttentionManager,
    MambaAlignManager,
    MambaManager,
    SingleTypeKVCacheManager,
)
from pagedkv.specs import CrossAttentionSpec, KVCacheConfig, KVCacheSpec, SpecDecodeConfig, cdiv

if TYPE_CHECKING:
    from pagedkv.request import Request

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SpecBucket:
    """Cacheable groups with an identical spec: one lookup serves them all.

    `get_cached_block(hash, group_ids)` hits only if every member group has the hash.
    """

    group_ids: tuple[int, ...]
    manager: SingleTypeKVCacheManager  # the first member; its hit search serves the bucket
    is_full_attention: bool  # hits are downward closed: any prefix of a hit is a hit
    use_eagle: bool = False  # some member is a draft group: hits drop the EAGLE block


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Prefix caching across groups of different attention types and block sizes.

    Invariants: every cacheable group's block size is a multiple of `hash_block_size`; hits
    and cached token counts are multiples of `scheduler_block_size` (the LCM of the group
    block sizes), so a hit is a whole number of blocks in every group. Non-cacheable groups
    get no hit blocks. Cross-attention groups are rejected: caching the decoder's KV of an
    encoder-decoder model would reuse it across different encoder inputs.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        hash_block_size: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        max_in_flight_tokens: int | None = None,
        metrics_collector: BlockResidencyObserver | None = None,
        scheduler_block_size: int | None = None,
        eviction: EvictionConfig | None = None,
        spec_decode: SpecDecodeConfig = NO_SPEC_DECODE,
        context_parallel: tuple[int, int] = (1, 1),
    ) -> None:
        groups = kv_cache_config.kv_cache_groups
        if enable_caching:
            for group_id, group in enumerate(groups):
                spec = group.kv_cache_spec
                if isinstance(spec, CrossAttentionSpec):
                    raise ConfigError(
                        f"group {group_id} is cross-attention: prefix caching must be off for "
                        "encoder-decoder models (enable_caching=False)"
                    )
                if spec.prefix_cacheable and spec.block_size % hash_block_size:
                    raise ConfigError(
                        f"group {group_id}'s block size {spec.block_size} is not a multiple of "
                        f"hash_block_size {hash_block_size}"
                    )
        group_lcm = lcm(
            *(g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.covers_token_range)
        )
        if scheduler_block_size is not None and scheduler_block_size % group_lcm:
            raise ConfigError(
                f"scheduler_block_size {scheduler_block_size} is not a multiple of the group "
                f"block sizes' LCM {group_lcm}"
            )
        self.scheduler_block_size = scheduler_block_size or group_lcm
        self.cache_alignment_tokens = self.scheduler_block_size
        super().__init__(
            kv_cache_config,
            max_model_len,
            hash_block_size,
            enable_caching,
            enable_kv_cache_events,
            max_in_flight_tokens,
            metrics_collector,
            alignment_tokens=self.scheduler_block_size,
            eviction=eviction,
            spec_decode=spec_decode,
            context_parallel=context_parallel,
        )
        self.enable_partial_hash_hits = enable_caching and self._partial_hits_supported()
        if self.enable_partial_hash_hits:
            # Hits may end on any hash block, and every computed token is cacheable.
            self.cache_alignment_tokens = 1
            for manager in self.single_type_managers:
                manager.alignment_tokens = hash_block_size
        if enable_caching:
            for manager in self.single_type_managers:
                # vLLM 0.33 enters the prompt's tail hash boundary inside a larger
                # full-attention block (looked up only with sub-block hits on).
                manager.registers_partial_tails = (
                    manager.enable_caching
                    and type(manager) is FullAttentionManager
                    and manager.block_size != hash_block_size
                )
        self._registers_partial_tails = any(
            manager.registers_partial_tails for manager in self.single_type_managers
        )
        self.spec_buckets = self._make_buckets()
        # "Full attention + one other type": the full-attention answer cannot be invalidated
        # by the other type's shorter one, so one pass suffices.
        self._is_simple_hybrid = (
            len(self.spec_buckets) == 2 and self.spec_buckets[0].is_full_attention
        )
        # The first full-attention group (None without one): per-group hits are judged
        # against it, as full attention is downward closed.
        first = self.spec_buckets[0] if self.spec_buckets else None
        self.full_attention_group_id = (
            first.group_ids[0] if first is not None and first.is_full_attention else None
        )

    def _partial_hits_supported(self) -> bool:
        """vLLM 0.33's rule: some Mamba "align" group has blocks larger than a hash block, and
        every other cacheable group can look up at hash-block granularity (or has blocks of
        one hash block)."""
        managers = self.single_type_managers
        # Under DCP a Mamba block of one hash block qualifies too: the sharded full-attention
        # blocks are the ones larger than a hash block then.
        if not any(
            isinstance(manager, MambaAlignManager)
            and (
                manager.block_size > self.hash_block_size
                or (self.dcp_world_size > 1 and manager.block_size >= self.hash_block_size)
            )
            for manager in managers
        ):
            return False
        unsupported = sorted(
            {
                type(manager).__name__
                for manager in managers
                if manager.enable_caching
                and not manager.supports_fine_grained_hash_lookup
                and manager.block_size != self.hash_block_size
            }
        )
        if unsupported:
            logger.warning(
                "Disabling fine-grained prefix-cache hits because these KV cache managers "
                "require block-aligned lookups: %s.",
                ", ".join(unsupported),
            )
            return False
        return True

    def _make_buckets(self) -> tuple[SpecBucket, ...]:
        """Bucket cacheable groups by spec, full attention first, otherwise in group order."""
        members: dict[KVCacheSpec, list[int]] = {}
        for group_id, manager in enumerate(self.single_type_managers):
            if manager.enable_caching:
                members.setdefault(manager.kv_cache_spec, []).append(group_id)
        buckets = []
        for group_ids in members.values():
            manager = self.single_type_managers[group_ids[0]]
            use_eagle = any(group_id in self.drop_eagle_group_ids for group_id in group_ids)
            if use_eagle:
                for group_id in group_ids:
                    self.single_type_managers[group_id].use_eagle = True
            buckets.append(
                SpecBucket(
                    tuple(group_ids),
                    manager,
                    isinstance(manager, FullAttentionManager),
                    use_eagle,
                )
            )
        buckets.sort(key=lambda bucket: not bucket.is_full_attention)  # stable
        return tuple(buckets)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """The longest prefix (at most `max_cache_hit_length` tokens) cached in every group.

        A fixed point, in passes over the buckets: each bucket answers with its longest hit no
        longer than the current candidate, which becomes the new candidate; a pass that changes
        nothing ends it (one pass for the simple hybrid). A full-attention bucket already asked
        just clamps (any prefix of its hit is a hit). An EAGLE bucket looks one block further
        and drops it, once per candidate length (a shrink by another bucket re-arms it).
        Candidates only shrink, so the loop ends. Also returns how far the longest single
        bucket reached past the result (the uncached common prefix).
        """
        buckets = self.spec_buckets
        num_groups = len(self.single_type_managers)
        if not buckets or max_cache_hit_length <= 0:
            return tuple([] for _ in range(num_groups)), 0, 0
        max_hashed_tokens = len(block_hashes) * self.hash_block_size
        group_hits: list[list[KVCacheBlock] | None] = [None] * num_groups
        group_hit_lengths = [0] * num_groups
        eagle_verified: set[int] = set()
        hit_length = max_cache_hit_length
        longest_hit_length = 0
        while True:
            candidate = hit_length
            for index, bucket in enumerate(buckets):
                first = bucket.group_ids[0]
                if bucket.is_full_attention and group_hits[first] is not None:
                    candidate = min(candidate, group_hit_lengths[first])
                    continue
                drop_eagle_block = bucket.use_eagle and index not in eagle_verified
                blocks, new_length = self._bucket_hit(
                    bucket, block_hashes, candidate, drop_eagle_block, max_hashed_tokens
                )
                if drop_eagle_block:
                    eagle_verified.add(index)
                elif new_length < candidate:
                    eagle_verified.clear()  # a shorter candidate: EAGLE buckets drop again
                candidate = new_length
                for group_id, hits in zip(bucket.group_ids, blocks, strict=True):
                    group_hits[group_id] = hits
                    group_hit_lengths[group_id] = new_length
                if candidate > longest_hit_length:
                    longest_hit_length = candidate
            if candidate >= hit_length:
                break
            hit_length = candidate
            if hit_length == 0:
                # Every bucket would answer 0 from here on: no hit anywhere.
                return tuple([] for _ in range(num_groups)), 0, longest_hit_length
            if self._is_simple_hybrid:
                break
        for bucket in buckets:
            if bucket.is_full_attention:
                num_blocks = cdiv(hit_length, bucket.manager.block_size)
                for group_id in bucket.group_ids:
                    trimmed = group_hits[group_id]
                    if trimmed is not None:
                        del trimmed[num_blocks:]
        return (
            tuple(hits if hits is not None else [] for hits in group_hits),
            hit_length,
            longest_hit_length - hit_length,
        )

    def _bucket_hit(
        self,
        bucket: SpecBucket,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        drop_eagle_block: bool,
        max_hashed_tokens: int,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """One bucket's longest hit within `max_length`; an EAGLE drop looks one block further
        first (not Mamba: draft models have no Mamba layers, so it never drops)."""
        manager = bucket.manager
        if drop_eagle_block and not isinstance(manager, MambaManager):
            # The EAGLE drop unit: a hash block where hits may end inside a block, else one.
            margin = manager.block_size
            if self.enable_partial_hash_hits and manager.supports_fine_grained_hash_lookup:
                margin = min(margin, self.hash_block_size)
            max_length = min(max_length + margin, max_hashed_tokens)
        return manager.find_longest_cache_hit(
            block_hashes,
            max_length,
            bucket.group_ids,
            self.block_pool,
            manager.kv_cache_spec,
            manager.alignment_tokens,
            drop_eagle_block,
        )

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], tuple[int, ...]]:
        """Each bucket's own longest hit (no reconciliation): blocks and hit length per group.

        For a KV connector that can restore one group's state past another's hit.
        """
        num_groups = len(self.single_type_managers)
        group_hits: list[list[KVCacheBlock]] = [[] for _ in range(num_groups)]
        group_hit_lengths = [0] * num_groups
        max_hashed_tokens = len(block_hashes) * self.hash_block_size
        for bucket in self.spec_buckets:
            blocks, hit_length = self._bucket_hit(
                bucket, block_hashes, max_cache_hit_length, bucket.use_eagle, max_hashed_tokens
            )
            for group_id, hits in zip(bucket.group_ids, blocks, strict=True):
                group_hits[group_id] = hits
                group_hit_lengths[group_id] = hit_length
        return tuple(group_hits), tuple(group_hit_lengths)

    def check_invariants(self, held_outside: Iterable[KVCacheBlock] = ()) -> None:
        """The base's checks, plus: the buckets cover exactly the cacheable groups, by spec."""
        super().check_invariants(held_outside)
        managers = self.single_type_managers
        bucketed = sorted(group_id for bucket in self.spec_buckets for group_id in bucket.group_ids)
        cacheable = [group_id for group_id, m in enumerate(managers) if m.enable_caching]
        if bucketed != cacheable:
            raise InvariantViolation(f"buckets cover groups {bucketed}, cacheable are {cacheable}")
        for bucket in self.spec_buckets:
            for group_id in bucket.group_ids:
                member = managers[group_id]
                if member.kv_cache_spec != bucket.manager.kv_cache_spec:
                    raise InvariantViolation(f"group {group_id}'s spec differs from its bucket's")

    def get_num_cacheable_tokens(self, num_computed_tokens: int, group_id: int) -> int:
        """`num_computed_tokens` rounded down to `scheduler_block_size`, where hits can end
        (not rounded with sub-block hits).

        An EAGLE group may cache one block more (its hits look one block past the boundary),
        of the tokens that cannot be prefilled again.
        """
        block = self.cache_alignment_tokens
        num_aligned = num_computed_tokens // block * block
        manager = self.single_type_managers[group_id]
        if manager.use_eagle and num_aligned > 0:
            num_final = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(num_final, num_final // block * block + manager.block_size)
        return num_aligned

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache full blocks up to the cacheable tokens of each group (see above)."""
        if (
            num_computed_tokens >= self.scheduler_block_size
            or self.enable_partial_hash_hits
            or self._registers_partial_tails
        ):
            super().cache_blocks(request, num_computed_tokens)
