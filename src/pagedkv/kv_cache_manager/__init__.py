"""Facade layer: the scheduler-facing `KVCacheManager` (the reference's API) and its result types.

`manager` holds the class; `checks` its argument checks and `events` the `BlockStored`
annotation it applies when draining events (also used by the vLLM adapter). The result types
live in `pagedkv.kv_cache_blocks`, below the coordinators that build them.
"""

from pagedkv.block_pool import BlockResidencyObserver
from pagedkv.kv_cache_blocks import ComputedBlocks, DecodeSlots, KVCacheBlockCopy, KVCacheBlocks
from pagedkv.kv_cache_manager.checks import (
    AllocationChecker,
    check_count,
    check_host_tier_layout,
    check_manager_config,
)
from pagedkv.kv_cache_manager.events import annotate_block_stored, event_metadata
from pagedkv.kv_cache_manager.manager import KVCacheManager

__all__ = [
    "AllocationChecker",
    "BlockResidencyObserver",
    "ComputedBlocks",
    "DecodeSlots",
    "KVCacheBlockCopy",
    "KVCacheBlocks",
    "KVCacheManager",
    "annotate_block_stored",
    "check_count",
    "check_host_tier_layout",
    "check_manager_config",
    "event_metadata",
]
