"""Mamba sizing as vLLM 0.33's planner counts it, and the managers agree with it.

A request holds one state block per Mamba group in mode "none" (vLLM's default without prefix
caching; the block spans `max_model_len`), two in mode "align" (with caching), plus its
speculative blocks. Jamba-v0.1 with 80 GiB at 32,768 tokens: vLLM's
`get_max_concurrency_for_kv_cache_config` gives 65536 / (7 + 410) = 157.16 ("none") and
65536 / (14 + 410) = 154.57 ("align"), computed with vLLM's own planner on the same specs.
"""

from __future__ import annotations

import pytest

from pagedkv import KVCacheManager, MambaSpec
from pagedkv.sched import Scheduler, SchedulerConfig
from pagedkv.sizing import size_kv_cache
from pagedkv.sizing.model_config import load_model_description

GIB = 2**30


@pytest.mark.parametrize(
    ("mode", "mamba_blocks", "concurrency"), [("none", 1, 157.16), ("align", 2, 154.57)]
)
def test_jamba_concurrency_matches_vllms_planner(mode, mamba_blocks, concurrency):
    model = load_model_description("jamba-v0.1", mamba_cache_mode=mode)
    result = size_kv_cache(model.layer_to_spec, 80 * GIB, 32768, max_in_flight_tokens=8192)
    assert result.num_blocks == 65536
    assert result.blocks_per_request == (mamba_blocks,) * 7 + (410,)
    assert round(result.max_concurrency, 2) == concurrency
    mamba_block_sizes = {
        g.kv_cache_spec.block_size
        for g in result.kv_cache_config.kv_cache_groups
        if isinstance(g.kv_cache_spec, MambaSpec)
    }
    # "none": one block spans the model length (as vLLM sets it); "align": the attention's.
    assert mamba_block_sizes == ({32768} if mode == "none" else {80})


@pytest.mark.parametrize("mode", ["none", "align"])
def test_a_sized_jamba_pool_holds_one_full_length_request_as_the_scheduler_checks(mode):
    model = load_model_description("jamba-v0.1", block_size=16, mamba_cache_mode=mode)
    result = size_kv_cache(model.layer_to_spec, 4 * GIB, 131072, max_in_flight_tokens=8192)
    manager = KVCacheManager(
        result.kv_cache_config,
        max_model_len=131072,
        max_in_flight_tokens=8192,
        enable_caching=mode == "align",
    )
    # The scheduler refuses a pool that cannot hold one max_model_len request; sizing said
    # this one can, and the managers' admission counts agree.
    Scheduler(manager, SchedulerConfig(max_num_batched_tokens=8192, max_model_len=131072))
