"""Sampled block-residency metrics: the reference's example, the ring, sampling, and the hooks
driven by a real manager."""

from __future__ import annotations

import random

import pytest

from pagedkv import (
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheBlock,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)
from pagedkv.metrics.residency import KVCacheEvictionEvent, KVCacheMetricsCollector

S = 1_000_000_000


class FakeClock:
    def __init__(self) -> None:
        self.now_ns = 0

    def __call__(self) -> int:
        return self.now_ns

    def at(self, seconds: float) -> FakeClock:
        self.now_ns = int(seconds * S)
        return self


def test_reference_example_lifetime_idle_and_gap():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=clock)
    block = KVCacheBlock(5)
    clock.at(1)
    collector.on_block_allocated(block)
    clock.at(2)
    collector.on_block_accessed(block)
    clock.at(3)
    collector.on_block_accessed(block)
    clock.at(4)
    collector.on_block_evicted(block)
    assert collector.drain_events() == [KVCacheEvictionEvent(3.0, 1.0, (1.0,))]
    assert collector.drain_events() == []
    assert collector.num_tracked_blocks == 0


def test_never_accessed_block_lifetime_equals_idle():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=clock)
    block = KVCacheBlock(1)
    collector.on_block_allocated(clock.at(1) and block)
    clock.at(6)
    collector.on_block_evicted(block)
    assert collector.drain_events() == [KVCacheEvictionEvent(5.0, 5.0, ())]


def test_ring_keeps_last_four_accesses():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=clock)
    block = KVCacheBlock(2)
    collector.on_block_allocated(block)
    for seconds in (1, 2, 4, 7, 11, 16):
        clock.at(seconds)
        collector.on_block_accessed(block)
    clock.at(20)
    collector.on_block_evicted(block)
    # ring holds 4, 7, 11, 16
    assert collector.drain_events() == [KVCacheEvictionEvent(20.0, 4.0, (3.0, 4.0, 5.0))]


def test_unsampled_blocks_are_counted_not_tracked_and_reset_forgets():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(sample_rate=0.5, clock=clock, rng=random.Random(7))
    blocks = [KVCacheBlock(i) for i in range(1, 201)]
    for block in blocks:
        collector.on_block_allocated(block)
    tracked = collector.num_tracked_blocks
    assert 60 < tracked < 140  # seeded: about half
    for block in blocks:
        collector.on_block_evicted(block)
    assert len(collector.drain_events()) == tracked
    assert collector.take_block_counts() == (200, 200)
    assert collector.take_block_counts() == (0, 0)
    for block in blocks[:10]:
        collector.on_block_allocated(block)
    collector.reset()
    assert collector.num_tracked_blocks == 0
    collector.on_block_evicted(blocks[0])
    assert collector.drain_events() == []


def test_reallocation_without_eviction_starts_over():
    clock = FakeClock()
    rng = random.Random(0)
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=clock, rng=rng)
    block = KVCacheBlock(3)
    collector.on_block_allocated(clock.at(1) and block)
    collector.on_block_allocated(clock.at(5) and block)  # freed uncached, handed out again
    clock.at(6)
    collector.on_block_evicted(block)
    assert collector.drain_events() == [KVCacheEvictionEvent(1.0, 1.0, ())]


def test_pending_events_are_bounded():
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=FakeClock(), max_pending_events=2)
    for block_id in range(1, 5):
        block = KVCacheBlock(block_id)
        collector.on_block_allocated(block)
        collector.on_block_evicted(block)
    assert len(collector.drain_events()) == 2
    assert collector.num_dropped_events == 2


@pytest.mark.parametrize("rate", [0, -0.1, 1.5, True, "0.5"])
def test_sample_rate_is_validated(rate):
    with pytest.raises(InvalidArgumentError, match="sample_rate"):
        KVCacheMetricsCollector(sample_rate=rate)


def test_hooks_driven_by_a_real_manager():
    clock = FakeClock()
    collector = KVCacheMetricsCollector(sample_rate=1.0, clock=clock)
    spec = FullAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(num_blocks=5, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    manager = KVCacheManager(config, max_model_len=64, metrics_collector=collector)
    hasher = make_request_block_hasher(4)

    clock.at(1)
    first = Request("a", list(range(9)), block_hasher=hasher)
    assert manager.allocate_slots(first, 9).get_block_ids() == ([1, 2, 3],)
    manager.free(first)

    clock.at(3)  # a prefix hit on blocks 1 and 2
    second = Request("b", list(range(8)) + [99], block_hasher=hasher)
    hit = manager.get_computed_blocks(second)
    assert hit.num_computed_tokens == 8
    manager.allocate_slots(second, 1, hit.num_computed_tokens, hit.blocks)
    manager.free(second)

    clock.at(4)  # a fresh request needs all 4 usable blocks: every cached block is evicted
    third = Request("c", [7] * 16, block_hasher=hasher)
    assert manager.allocate_slots(third, 16) is not None
    events = collector.drain_events()
    # Only blocks 1 and 2 were cached (allocated at 1 s, hit at 3 s); block 3 held a partial
    # block each time and block 4 was never used before.
    assert events == [KVCacheEvictionEvent(3.0, 1.0, ()), KVCacheEvictionEvent(3.0, 1.0, ())]
    assert collector.take_block_counts() == (3 + 1 + 4, 2)
