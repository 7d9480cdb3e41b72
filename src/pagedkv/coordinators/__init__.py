"""Coordinators: one per manager, chosen once by `make_coordinator` from the configuration.

`base` holds the shared fan-out and the no-cache and single-group coordinators, `hybrid` the
multi-group hit search, `running` the fast paths for running requests. The factories live here
and in `running`, above the coordinators, so neither coordinator module imports the other's
subclasses (the base never knows the hybrid exists).
"""

from __future__ import annotations

from pagedkv.block_pool import BlockResidencyObserver
from pagedkv.coordinators.base import (
    NO_SPEC_DECODE,
    BlockLists,
    KVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
)
from pagedkv.coordinators.hybrid import HybridKVCacheCoordinator, SpecBucket
from pagedkv.coordinators.running import RunningAllocator, make_running_allocator
from pagedkv.eviction import EvictionConfig
from pagedkv.specs import KVCacheConfig, SpecDecodeConfig


def make_coordinator(
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
    dcp_world_size: int = 1,
    pcp_world_size: int = 1,
) -> KVCacheCoordinator:
    """Pick the coordinator once: no caching, one group, or a hybrid of several groups.

    `kv_cache_config` is the managers' view (sharded block sizes already scaled by
    `dcp_world_size`, see `specs.shard_across_context_parallel_ranks`)."""
    args = (
        kv_cache_config,
        max_model_len,
        hash_block_size,
        enable_caching,
        enable_kv_cache_events,
        max_in_flight_tokens,
        metrics_collector,
    )
    parallel = (dcp_world_size, pcp_world_size)
    num_groups = len(kv_cache_config.kv_cache_groups)
    if not enable_caching or num_groups == 0:
        return KVCacheCoordinatorNoPrefixCache(
            *args, eviction=eviction, spec_decode=spec_decode, context_parallel=parallel
        )
    if num_groups == 1:
        return UnitaryKVCacheCoordinator(
            *args, eviction=eviction, spec_decode=spec_decode, context_parallel=parallel
        )

    return HybridKVCacheCoordinator(
        *args,
        scheduler_block_size=scheduler_block_size,
        eviction=eviction,
        spec_decode=spec_decode,
        context_parallel=parallel,
    )


__all__ = [
    "BlockLists",
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "RunningAllocator",
    "SpecBucket",
    "UnitaryKVCacheCoordinator",
    "make_coordinator",
    "make_running_allocator",
]
