"""Hybrid coordinator: several KV-cache groups (attention types, block sizes) with prefix caching.

Finds the longest prefix hit valid in every group and caches only whole multiples of the groups'
common block size. Chosen by `make_coordinator` for more than one group; the single-group path
never imports this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import lcm
from typing import TYPE_CHECKING

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockResidencyObserver
from pagedkv.coordinators.base import KVCacheCoordinator
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction import EvictionConfig
from pagedkv.managers import FullAttentionManager, MambaManager, SingleTypeKVCacheManager
from pagedkv.specs import CrossAttentionSpec, KVCacheConfig, KVCacheSpec

if TYPE_CHECKING:
    from pagedkv.request import Request


@dataclass(frozen=True, slots=True)
class SpecBucket:
    """Cacheable groups with an identical spec: one lookup serves them all.

    `get_cached_block(hash, group_ids)` hits only if every member group has the hash.
    """

    group_ids: tuple[int, ...]
    manager: SingleTypeKVCacheManager  # the first member; its hit search serves the bucket
    is_full_attention: bool  # hits are downward closed: any prefix of a hit is a hit


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
        group_lcm = lcm(*(g.kv_cache_spec.block_size for g in groups))
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
        )
        self.spec_buckets = self._make_buckets()

    def _make_buckets(self) -> tuple[SpecBucket, ...]:
        """Bucket cacheable groups by spec, full attention first, otherwise in group order."""
        members: dict[KVCacheSpec, list[int]] = {}
        for group_id, manager in enumerate(self.single_type_managers):
            if manager.enable_caching:
                members.setdefault(manager.kv_cache_spec, []).append(group_id)
        buckets = []
        for group_ids in members.values():
            manager = self.single_type_managers[group_ids[0]]
            if isinstance(manager, MambaManager):
                # A hit is valid only if no member's block was cached this step: share one record.
                for group_id in group_ids[1:]:
                    member = self.single_type_managers[group_id]
                    if isinstance(member, MambaManager):  # same spec, so always
                        member.block_ids_cached_this_step = manager.block_ids_cached_this_step
            buckets.append(
                SpecBucket(tuple(group_ids), manager, isinstance(manager, FullAttentionManager))
            )
        buckets.sort(key=lambda bucket: not bucket.is_full_attention)  # stable
        return tuple(buckets)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """The longest prefix (at most `max_cache_hit_length` tokens) cached in every group.

        A fixed point: each bucket in turn answers with its longest hit no longer than the
        current candidate, which becomes the new candidate. It ends once every bucket agrees
        with the candidate in a row. A full-attention bucket already asked agrees without a
        second lookup (any prefix of its hit is a hit), so "full attention + one other type"
        takes one lookup per bucket. Candidates only shrink, so the loop ends.
        """
        buckets = self.spec_buckets
        group_hits: list[list[KVCacheBlock]] = [[] for _ in self.single_type_managers]
        num_buckets = len(buckets)
        if not num_buckets or max_cache_hit_length <= 0:
            return tuple(group_hits), 0
        block_pool = self.block_pool
        candidate = max_cache_hit_length
        looked_up = [False] * num_buckets
        num_agreeing = 0
        index = 0
        while num_agreeing < num_buckets:
            bucket = buckets[index]
            if bucket.is_full_attention and looked_up[index]:
                num_agreeing += 1
            else:
                manager = bucket.manager
                blocks, hit_length = manager.find_longest_cache_hit(
                    block_hashes,
                    candidate,
                    bucket.group_ids,
                    block_pool,
                    manager.kv_cache_spec,
                    manager.alignment_tokens,
                )
                looked_up[index] = True
                for group_id, hits in zip(bucket.group_ids, blocks, strict=True):
                    group_hits[group_id] = hits
                if hit_length < candidate:
                    candidate = hit_length
                    num_agreeing = 1
                    if candidate == 0:
                        return tuple([] for _ in self.single_type_managers), 0
                else:
                    num_agreeing += 1
            index = index + 1 if index + 1 < num_buckets else 0
        for bucket in buckets:
            if bucket.is_full_attention:
                num_blocks = candidate // bucket.manager.block_size
                for group_id in bucket.group_ids:
                    del group_hits[group_id][num_blocks:]
        return tuple(group_hits), candidate

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
                first = bucket.manager
                if (
                    isinstance(member, MambaManager)
                    and isinstance(first, MambaManager)
                    and member.block_ids_cached_this_step is not first.block_ids_cached_this_step
                ):
                    raise InvariantViolation(f"Mamba group {group_id} keeps its own step record")

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache full blocks up to `num_computed_tokens` rounded down to `scheduler_block_size`.

        A hit can only end on such a boundary, so blocks past the last one are not hashed yet.
        """
        alignment = self.cache_alignment_tokens
        num_tokens = num_computed_tokens // alignment * alignment
        if num_tokens:
            super().cache_blocks(request, num_tokens)
