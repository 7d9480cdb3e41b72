"""Facade layer, reports: what `KVCacheManager` tells its caller without allocating.

`KVCacheManagerReports` (a base of `KVCacheManager`) reads block tables and ids, usage,
prefix-cache and eviction stats, drains the KV events (annotating each `BlockStored` with its
group's spec) and checks the facade's invariants. Holds no state of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from pagedkv.admission import check_count
from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.coordinators import KVCacheCoordinator
from pagedkv.errors import InvariantViolation
from pagedkv.events import BlockStored, KVCacheEvent
from pagedkv.eviction import EvictionStats
from pagedkv.kv_cache_blocks import KVCacheBlocks
from pagedkv.request import Request
from pagedkv.specs import KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.stats import PrefixCacheStats

logger = logging.getLogger("pagedkv.kv_cache_manager")


def event_metadata(groups: Sequence[KVCacheGroupSpec]) -> tuple[tuple[str, int | None], ...]:
    """Per group, the spec kind and sliding window (None if none) that `take_events` writes
    into each of the group's `BlockStored` events."""
    return tuple(
        (
            g.kv_cache_spec.kind,
            g.kv_cache_spec.sliding_window
            if isinstance(g.kv_cache_spec, SlidingWindowSpec)
            else None,
        )
        for g in groups
    )


class KVCacheManagerReports:
    """Reads and drains of a `KVCacheManager` (the attributes below are the manager's, set by
    its `__init__`)."""

    enable_caching: bool
    log_stats: bool
    prefix_cache_stats: PrefixCacheStats | None
    coordinator: KVCacheCoordinator
    block_pool: BlockPool
    empty_kv_cache_blocks: KVCacheBlocks
    kv_cache_event_metadata: tuple[tuple[str, int | None], ...]
    _requests: dict[str, Request]

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_eviction_stats(self) -> EvictionStats:
        """The eviction policy, retention and host-tier counters (`pagedkv.eviction`)."""
        return self.block_pool.get_eviction_stats()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones (None if off)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one admitted request's lookup (preempted requests apart)."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        # None only with allow_none=True and no blocks; the default never returns it.
        return self.get_blocks(request_id).get_block_ids()  # type: ignore[return-value]

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        if all(not group for group in blocks):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(blocks)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks of the request held by every request holding blocks."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids per group, token-indexed groups clipped to the computed tokens' blocks.

        Cross-attention and Mamba groups are not indexed by decoder tokens: kept whole.
        """
        check_count("num_computed_tokens", num_computed_tokens)
        return self.coordinator.get_block_ids_for_computed_tokens(request_id, num_computed_tokens)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix in the prefix cache: per cacheable group, the end of
        its last hashed block; the minimum over groups (0 if none)."""
        return self.coordinator.estimate_cached_tokens(request.request_id)

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids of attention blocks allocated since the last call, for the worker to
        zero (recorded only with `KVCacheConfig.needs_kv_cache_zeroing`)."""
        return self.coordinator.take_new_block_ids()

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the pool's events, annotating `BlockStored` with its group's spec kind."""
        events = self.block_pool.take_events()
        metadata = self.kv_cache_event_metadata
        for event in events:
            if type(event) is BlockStored and event.group_idx is not None:
                if 0 <= event.group_idx < len(metadata):
                    event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = metadata[
                        event.group_idx
                    ]
                else:
                    logger.warning("KV event group %d is not in KV cache metadata", event.group_idx)
        return events

    def check_invariants(self, held_outside: Iterable[KVCacheBlock] = ()) -> None:
        """Check the pool, every manager and the facade's request registry.

        `held_outside`: blocks popped by `pop_blocks_for_free` and not freed yet (each
        occurrence is one reference no block table accounts for).
        """
        self.coordinator.check_invariants(held_outside)
        null_block = self.block_pool.null_block
        for group_id, manager in enumerate(self.coordinator.single_type_managers):
            for request_id, blocks in manager.req_to_blocks.items():
                request = self._requests.get(request_id)
                if request is None:
                    raise InvariantViolation(f"request {request_id!r} holds blocks but is unknown")
                if not manager.enable_caching:
                    continue
                hashes = manager.resolve_hashes(request.block_hashes)
                for index in range(manager.num_cached_block.get(request_id, 0)):
                    block = blocks[index]
                    if block is null_block or block.block_hash is None:
                        continue  # evict_blocks may drop the entry of a held block
                    if (
                        index >= len(hashes)
                        or block.block_hash != hashes[index]
                        or block.hash_group_id != group_id
                    ):
                        raise InvariantViolation(
                            f"request {request_id!r}: block {block.block_id} at position {index} "
                            f"of group {group_id} is cached under another hash"
                        )
        usage = self.usage
        if not 0.0 <= usage <= 1.0:
            raise InvariantViolation(f"usage {usage} outside [0, 1]")
