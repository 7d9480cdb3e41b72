"""Sizing and the managers agree on what a Mamba hybrid holds per request."""

from __future__ import annotations

from pagedkv import KVCacheManager, MambaSpec
from pagedkv.sched import Scheduler, SchedulerConfig
from pagedkv.sizing import size_kv_cache
from pagedkv.sizing.model_config import load_model_description
from pagedkv.specs import cdiv


def test_mamba_spec_counts_the_blocks_of_tokens_in_flight_plus_the_settled_state():
    spec = MambaSpec(80, shapes=((4, 8),), dtype_bytes=2)
    assert spec.max_admission_blocks(131072, 8192) == cdiv(8192, 80) + 1 == 104
    assert spec.max_admission_blocks(1000, 8192) == cdiv(1000, 80) + 1
    assert spec.max_memory_usage_bytes(131072, 8192) == 104 * spec.page_size_bytes


def test_a_sized_jamba_pool_holds_one_full_length_request_as_the_scheduler_checks():
    model = load_model_description("jamba-v0.1", block_size=16)
    result = size_kv_cache(model.layer_to_spec, 4 * 2**30, 131072, max_in_flight_tokens=8192)
    groups = result.kv_cache_config.kv_cache_groups
    mamba_groups = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert mamba_groups, "jamba has Mamba layers"
    for group_id, group in enumerate(groups):
        if isinstance(group.kv_cache_spec, MambaSpec):
            block_size = group.kv_cache_spec.block_size
            assert result.blocks_per_request[group_id] == cdiv(8192, block_size) + 1
    manager = KVCacheManager(
        result.kv_cache_config, max_model_len=131072, max_in_flight_tokens=8192
    )
    # The scheduler refuses a pool that cannot hold one max_model_len request; sizing said
    # this one can, and the managers' admission caps agree.
    Scheduler(manager, SchedulerConfig(max_num_batched_tokens=8192, max_model_len=131072))
