"""The drop-in's constructor and views against vLLM 0.33's own manager, call for call (issue 23
items 2 and 3): same refusals, bools as ints, vLLM-shaped pool, map, blocks and coordinator.
Needs the `[vllm]` extra (`.ci/vllm-suites` runs it in its vLLM venv; skipped elsewhere)."""

from __future__ import annotations

import copy
import math

import pytest

vllm = pytest.importorskip("vllm", reason="no vLLM in this venv: .ci/vllm-suites runs this")
torch = pytest.importorskip("torch")

from vllm.distributed import kv_events as vllm_events  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks as VllmKVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    make_block_hash_with_group_id,
)
from vllm.v1.kv_cache_interface import (  # noqa: E402
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from pagedkv.integrations.vllm import PagedKVCacheManager  # noqa: E402
from pagedkv.kv_cache_blocks import KVCacheBlocks  # noqa: E402

init_none_hash(sha256)
DTYPE = torch.float16


def full(block_size):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=DTYPE)


def swa(block_size, window):
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=DTYPE, sliding_window=window
    )


def config(num_blocks, specs, retention=None):
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=groups,
        prefix_cache_retention_interval=retention,
    )


def kwargs_for(specs, **kwargs):
    sizes = [spec.block_size for spec in specs]
    return {
        "max_model_len": 8192,
        "scheduler_block_size": math.lcm(*sizes),
        "hash_block_size": math.gcd(*sizes),
        "enable_caching": True,
        **kwargs,
    }


def both(num_blocks, *specs, retention=None, **kwargs):
    kw = kwargs_for(specs, **kwargs)
    return tuple(
        cls(config(num_blocks, specs, retention), **kw)
        for cls in (VllmKVCacheManager, PagedKVCacheManager)
    )


def request(request_id, tokens, hash_block_size, lookahead=0):
    return Request(
        request_id,
        list(tokens),
        SamplingParams(max_tokens=100),
        None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256, lookahead),
    )


def refusal(cls, *args, **kwargs):
    with pytest.raises(Exception) as caught:
        cls(*args, **kwargs)
    return type(caught.value), str(caught.value)


@pytest.mark.parametrize(
    ("specs", "retention", "extra"),
    [
        ((full(32), swa(8, 8)), -32, {}),  # negative multiple: vLLM's "non-negative"
        ((full(32), swa(8, 8)), 33, {}),  # not a multiple of the scheduler block
        ((full(16),), 16, {}),  # no sliding-window or Mamba group
        ((full(4),), None, {"use_eagle": True, "num_prefill_lookahead": 5}),  # MTP
        ((full(16),), None, {"watermark": -0.5}),
    ],
)
def test_refusals_have_vllms_type_and_message(specs, retention, extra):
    kw = kwargs_for(specs, **extra)
    expected = refusal(VllmKVCacheManager, config(10, specs, retention), **kw)
    assert refusal(PagedKVCacheManager, config(10, specs, retention), **kw) == expected


@pytest.mark.parametrize("lookahead", [False, True])
def test_bool_hash_lookahead_means_zero_or_one(lookahead):
    managers = both(20, full(16), use_eagle=True, num_hash_lookahead_tokens=lookahead)
    tokens = list(range(70))
    results = []
    for manager in managers:
        first = request("a", tokens, 16, int(lookahead))
        hits, num_hit, _ = manager.get_computed_blocks(first)
        manager.allocate_slots(first, len(tokens), num_hit, hits)
        second = request("b", tokens, 16, int(lookahead))
        hits, num_hit, _ = manager.get_computed_blocks(second)
        results.append((hits.get_block_ids(), num_hit))
    assert results[0] == results[1]
    assert results[0][1] > 0


def test_pool_blocks_show_vllms_hash_and_group_form():
    managers = both(12, full(16), swa(16, 32))
    hashes = []
    for manager in managers:
        req = request("a", list(range(50)), 16)
        manager.allocate_slots(req, 50)
        hashes.append(
            [(block.block_hash, block.block_hash_num_tokens) for block in manager.block_pool.blocks]
        )
        # A view equals the block it shows (the one in the request's table).
        table = manager.get_blocks("a").blocks[1]
        assert manager.block_pool.blocks[table[0].block_id] == table[0]
    assert hashes[0] == hashes[1]
    assert sorted(n for h, n in hashes[0] if h is not None) == [16, 16, 32, 32, 48, 48]


def test_cache_full_blocks_with_vllms_signature_emits_the_same_event():
    events = []
    for manager in both(6, full(4), swa(4, 8), enable_kv_cache_events=True):
        req = request("a", list(range(8)), 4)
        pool = manager.block_pool
        blocks = pool.get_new_blocks(2)
        pool.cache_full_blocks(
            request=req,
            blocks=blocks,
            num_cached_blocks=0,
            num_full_blocks=2,
            block_size=4,
            kv_cache_group_id=1,
        )
        events.append(manager.take_events())
    assert events[0] == events[1]
    [stored] = events[1]
    assert stored.group_idx == 1 and stored.kv_cache_spec_sliding_window == 8


def test_a_vllm_event_in_the_queue_passes_through():
    event = vllm_events.BlockStored(
        block_hashes=[1],
        parent_block_hash=None,
        token_ids=[0, 1, 2, 3],
        block_size=4,
        lora_id=None,
        medium=None,
        lora_name=None,
        group_idx=0,
    )
    paged = both(5, full(4), enable_kv_cache_events=True)[1]
    paged.block_pool.kv_event_queue.append(event)
    assert paged.take_events() == [event]
    assert event.kv_cache_spec_kind == "full_attention"


def test_map_pops_and_restores_are_applied_like_vllms():
    hit_lengths = []
    for manager in both(30, full(32), swa(16, 32)):
        tokens = list(range(7 * 16 + 1))
        first = request("a", tokens, 16)
        manager.allocate_slots(first, len(tokens))
        cache = manager.block_pool.cached_block_hash_to_block
        lengths = [manager.get_computed_blocks(request("b", tokens, 16))[1]]
        # vLLM's test_different_block_size: pop the two last cached sliding-window entries.
        table = manager.get_blocks("a").blocks[1]
        keys = [make_block_hash_with_group_id(h, 1) for h in first.block_hashes[:7]]
        popped_ids = []
        for index in reversed(range(7)):
            if keys[index] in cache._cache and len(popped_ids) < 2:
                block_id = table[index].block_id
                assert cache.pop(keys[index], block_id + 100) is None  # wrong id: no change
                popped = cache.pop(keys[index], block_id)
                assert popped is not None and popped.block_id == block_id
                popped_ids.append(block_id)
        lengths.append(popped_ids)
        lengths.append(manager.get_computed_blocks(request("c", tokens, 16))[1])
        # vLLM's _test_partial_request_hit: pop whole keys from `_cache`, then restore them.
        backup = copy.copy(cache._cache)
        key0 = make_block_hash_with_group_id(first.block_hashes[0], 1)
        cache._cache.pop(key0)
        lengths.append(manager.get_computed_blocks(request("d", tokens, 16))[1])
        cache._cache[key0] = backup[key0]
        lengths.append(manager.get_computed_blocks(request("e", tokens, 16))[1])
        lengths.append(len(cache))
        hit_lengths.append(lengths)
    assert hit_lengths[0] == hit_lengths[1]
    assert hit_lengths[1][0] == 96 and hit_lengths[1][2] < 96


def test_coordinator_names_and_alignment_are_vllms():
    cases = [((full(16),), None), ((full(32), swa(16, 32)), 64), ((full(16),), 0)]
    for specs, retention in cases:
        reference, paged = both(20, *specs, retention=retention)
        for name in ("retention_interval", "_cache_hit_alignment_tokens"):
            assert hasattr(paged.coordinator, name) == hasattr(reference.coordinator, name)
            if hasattr(reference.coordinator, name):
                assert getattr(paged.coordinator, name) == getattr(reference.coordinator, name)
        assert type(paged.coordinator).__name__ == type(reference.coordinator).__name__
        assert [type(m).__name__ for m in paged.coordinator.single_type_managers] == [
            type(m).__name__ for m in reference.coordinator.single_type_managers
        ]


def test_uncached_free_blocks_given_as_hits_are_adopted_like_vllms():
    tables = []
    for manager in both(40, full(16), swa(16, 32), use_eagle=True):
        head = manager.block_pool.free_block_queue.fake_free_list_head
        top = []
        for _ in range(10):
            head = head.next_free_block
            top.append(head)
        blocks_type = (
            KVCacheBlocks if isinstance(manager, PagedKVCacheManager) else VllmKVCacheBlocks
        )
        req = request("a", [0] * 128, 16)
        manager.allocate_slots(req, 16, 80, blocks_type((top[:5], top[5:])), 0, 32)
        tables.append(manager.get_block_ids("a"))
    assert tables[0] == tables[1]
    flat = [block_id for group in tables[1] for block_id in group]
    assert len(set(flat) - {0}) == len([b for b in flat if b])


@pytest.mark.parametrize(
    ("specs", "use_eagle"),
    [
        ((full(16),), True),  # no Mamba group: no sub-block hits
        ((full(2), MambaSpec(block_size=8, shapes=(1, 1), dtypes=(DTYPE,),
                             mamba_cache_mode="align")), False),  # no EAGLE
        ((full(2), MambaSpec(block_size=8, shapes=(1, 1), dtypes=(DTYPE,),
                             mamba_cache_mode="align")), True),  # on
    ],
)  # fmt: skip
def test_the_shared_prefix_checkpoint_is_narrowed_like_vllms(specs, use_eagle):
    # vLLM keeps the flag only for an EAGLE Mamba "align" model with sub-block hash hits.
    kw = kwargs_for(specs, use_eagle=use_eagle, enable_mamba_shared_prefix_checkpoint=True)
    flags = []
    for cls in (VllmKVCacheManager, PagedKVCacheManager):
        manager = cls(config(40, specs), **kw)
        mamba_flags = [
            manager.shared_prefix_checkpoint
            for manager in manager.coordinator.single_type_managers
            if type(manager).__name__ == "MambaManager"
        ]
        flags.append((manager.mamba_shared_prefix_checkpoint, mamba_flags))
    assert flags[0] == flags[1]
    assert flags[1][0] is (len(specs) == 2 and use_eagle)


def test_bounded_replay_windows_are_allocated_like_vllms():
    # DeepSeek-V4.1's replayed window: never cached, no hit blocks, nulls where the window no
    # longer reaches. The same prompts on both managers give the same tables, hits and events.
    window = SlidingWindowMLASpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype=DTYPE, sliding_window=32,
        bounded_replay=True,
    )  # fmt: skip
    results = []
    for manager in both(64, full(16), window, enable_kv_cache_events=True):
        seen = []
        for request_id, tokens in (("a", range(100)), ("b", range(100)), ("c", range(70))):
            req = request(request_id, tokens, 16)
            hits, num_hit, _ = manager.get_computed_blocks(req)
            manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
            seen.append((hits.get_block_ids(), num_hit, manager.get_block_ids(request_id)))
            if request_id != "b":
                manager.free(req)
        events = [
            (type(e).__name__, len(getattr(e, "block_hashes", ()))) for e in manager.take_events()
        ]
        results.append((seen, events))
    assert results[0] == results[1]
    (first, second, third), events = results[1]
    assert second[:2] == (([1, 2, 3, 4, 5, 6], []), 96)
    assert second[2][1][:4] == [0, 0, 0, 0]  # 96 computed: the window starts at 65
    assert third[1] == 64 and events == [("BlockStored", 6)]


def test_circular_buffer_rings_are_allocated_like_vllms():
    # A compressor's ring beside paged attention: one block per request, kept to the free.
    # (vLLM asserts that the ring's capacity divides the scheduler block, as for any group.)
    ring = CircularBufferSpec(block_size=8, num_kv_heads=1, head_size=8, dtype=DTYPE)
    results = []
    for cls in (VllmKVCacheManager, PagedKVCacheManager):
        manager = cls(
            config(40, (full(16), ring)),
            max_model_len=8192,
            scheduler_block_size=16,
            hash_block_size=16,
            enable_caching=True,
            enable_kv_cache_events=True,
        )
        seen = []
        for request_id, tokens in (("a", range(50)), ("b", range(50)), ("c", range(20))):
            req = request(request_id, tokens, 16)
            hits, num_hit, _ = manager.get_computed_blocks(req)
            manager.allocate_slots(req, req.num_tokens - num_hit, num_hit, hits)
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(7)
            manager.allocate_slots(req, 1)
            seen.append((hits.get_block_ids(), num_hit, manager.get_block_ids(request_id)))
            if request_id != "b":
                manager.free(req)
        events = [
            (type(e).__name__, len(getattr(e, "block_hashes", ()))) for e in manager.take_events()
        ]
        free_ids = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
        results.append((seen, events, free_ids))
    assert results[0] == results[1]
    (first, second, _), _, _ = results[1]
    assert second[:2] == (([1, 2, 3], []), 48) and len(second[2][1]) == 1


def test_mamba_boundary_state_offers_are_vllms():
    # Mamba "align" states a connector may offload: every state block a step caches, with its
    # boundary; withdrawn when the request is freed before they are taken.
    state = MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(DTYPE,), mamba_cache_mode="align")
    offers = []
    for manager in both(40, full(16), state):
        seen = []
        req = request("a", range(70), 16)
        for start, end in ((0, 32), (32, 64), (64, 70)):  # chunks ending on block boundaries
            manager.new_step_starts()
            manager.allocate_slots(req, end - start)
            req.num_computed_tokens = end
            seen.append(manager.take_boundary_state_offloads())
        other = request("b", range(100, 148), 16)
        manager.new_step_starts()
        manager.allocate_slots(other, 48)
        manager.free(other)  # its offers go with its blocks
        seen.append(manager.take_boundary_state_offloads())
        # Async scheduling: update_from_output caches what a step computed, between steps;
        # the offer waits for the next schedule()'s take.
        late = request("c", range(200, 270), 16)
        manager.new_step_starts()
        manager.allocate_slots(late, 32, delay_cache_blocks=True)
        late.num_computed_tokens = 32
        manager.cache_blocks(late, 32)
        manager.new_step_starts()
        seen.append(manager.take_boundary_state_offloads())
        offers.append(seen)
    assert offers[0] == offers[1]
    boundaries = [[b for _, _, b in step.get("a", [])] for step in offers[1][:3]]
    assert boundaries == [[32], [64], []] and offers[1][3] == {}
    assert [b for _, _, b in offers[1][4]["c"]] == [32]


def test_rswa_gaps_are_freed_like_vllms():
    # R-SWA: the prompt stays, generated tokens only within the window; the gap between is
    # freed as decoding goes on. Tables, freed order and a later hit match vLLM's call for call.
    spec = RSWASpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE, rswa_window=8)
    results = []
    for manager in both(40, spec):
        req = request("a", range(10), 4)
        manager.allocate_slots(req, 10)
        req.num_computed_tokens = 10
        tables = []
        for token in range(30):
            req.append_output_token_ids(1000 + token)
            manager.allocate_slots(req, 1)
            req.num_computed_tokens += 1
            tables.append(manager.get_block_ids("a")[0])
        free_ids = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
        manager.free(req)
        again = request("b", range(10), 4)
        hits, num_hit, _ = manager.get_computed_blocks(again)
        results.append((tables, free_ids, hits.get_block_ids(), num_hit))
    assert results[0] == results[1]
    tables = results[1][0]
    # 40 tokens: the prompt's 3 blocks, the gap nulled up to the window, the window's blocks.
    assert tables[-1][:3] == [1, 2, 3] and 0 in tables[-1]
    assert results[1][2:] == (([1, 2],), 8)


def test_extra_retained_window_tokens_are_freed_like_vllms():
    # Multi-module MTP re-prefills the last tokens: a window keeps extra_retained_tokens more
    # below it. Same tables, free order and admission count as vLLM's manager.
    window = SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE, sliding_window=8,
        extra_retained_tokens=5,
    )  # fmt: skip
    results = []
    for manager in both(40, full(4), window):
        req = request("a", range(10), 4)
        manager.allocate_slots(req, 10)
        req.num_computed_tokens = 10
        tables = []
        for token in range(20):
            req.append_output_token_ids(1000 + token)
            manager.allocate_slots(req, 1)
            req.num_computed_tokens += 1
            tables.append(manager.get_block_ids("a")[1])
        free_ids = [b.block_id for b in manager.block_pool.free_block_queue.get_all_free_blocks()]
        results.append((tables, free_ids))
    assert results[0] == results[1]
    # 29 processed: 17 tokens skipped (22 without the 5 retained), so 4 blocks are null, not 5.
    assert results[1][0][-1][:4] == [0, 0, 0, 0] and results[1][0][-1][4] != 0
