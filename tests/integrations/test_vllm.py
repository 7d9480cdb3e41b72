"""pagedkv.integrations.vllm against vLLM 0.33's own KVCacheManager, call for call.

Each scenario drives both managers with the same vLLM config and the same vLLM `Request`
objects and asserts identical results: new block ids, hits, tables, free-queue order, events
(vLLM's own types), stats. Needs the `[vllm]` extra: `.ci/vllm-suites` runs it in its vLLM venv;
elsewhere it is skipped.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

# First: without vLLM, skip before importing torch. vLLM is not in [dev] (it pins its own torch
# and CUDA packages); `.ci/vllm-suites` runs this file in the vLLM venv it builds, so this skip
# is expected under `make test` (the reason avoids strict_setup's "could not import").
vllm = pytest.importorskip("vllm", reason="no vLLM in this venv: .ci/vllm-suites runs this")
torch = pytest.importorskip("torch")

from vllm.distributed import kv_events as vllm_events  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.single_type_kv_cache_manager import CrossAttentionManager  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.stats import PrefixCacheStats  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402

from pagedkv import ConfigError  # noqa: E402
from pagedkv.integrations.vllm import (  # noqa: E402
    AsyncScheduler,
    PagedKVCacheManager,
    Scheduler,
)
from pagedkv.integrations.vllm.scheduler import manager_class_in_vllm_scheduler  # noqa: E402

init_none_hash(sha256)
DTYPE = torch.float16


def full(block_size):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=DTYPE)


def swa(block_size, window):
    return SlidingWindowSpec(
        block_size=block_size, num_kv_heads=1, head_size=8, dtype=DTYPE, sliding_window=window
    )


def mamba(block_size, mode="align", num_speculative_blocks=0):
    return MambaSpec(
        block_size=block_size,
        shapes=((4, 8),),
        dtypes=(DTYPE,),
        mamba_cache_mode=mode,
        num_speculative_blocks=num_speculative_blocks,
    )


def both(num_blocks, *specs, hash_block_size=None, retention=None, **kwargs):
    """vLLM's manager and pagedkv's, built with the Scheduler's keyword arguments."""
    import math

    block_sizes = [spec.block_size for spec in specs]
    kwargs = {
        "max_model_len": 8192,
        "scheduler_block_size": math.lcm(*block_sizes),
        "hash_block_size": hash_block_size or math.gcd(*block_sizes),
        "enable_caching": True,
        "log_stats": True,
        "enable_kv_cache_events": True,
        **kwargs,
    }

    def config():  # each manager gets its own (vLLM's config is mutable)
        groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
        return KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=groups,
            prefix_cache_retention_interval=retention,
        )

    return VllmKVCacheManager(config(), **kwargs), PagedKVCacheManager(config(), **kwargs)


def request(request_id, tokens, hash_block_size, lookahead=0):
    return Request(
        request_id,
        list(tokens),
        SamplingParams(max_tokens=100),
        None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256, lookahead),
    )


def ids(blocks):
    return None if blocks is None else blocks.get_block_ids()


def free_order(manager):
    pool = manager.block_pool
    if isinstance(manager, PagedKVCacheManager):
        return pool.free_block_ids()
    return [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


class Pair:
    """Drive both managers; every call's results must agree."""

    def __init__(self, reference, pagedkv):
        self.managers = (reference, pagedkv)
        self.lookups = {}

    def lookup(self, req, max_cache_hit_length=None):
        results = [m.get_computed_blocks(req, max_cache_hit_length) for m in self.managers]
        assert [(ids(r[0]), r[1], r[2]) for r in results] == [
            (ids(results[0][0]), results[0][1], results[0][2])
        ] * 2
        self.lookups[req.request_id] = results
        return ids(results[0][0]), results[0][1]

    def allocate(self, req, num_new_tokens, with_hit=False, **kwargs):
        results = []
        for index, manager in enumerate(self.managers):
            if with_hit:
                blocks, num_hit, _ = self.lookups[req.request_id][index]
                kwargs.update(num_new_computed_tokens=num_hit, new_computed_blocks=blocks)
            results.append(manager.allocate_slots(req, num_new_tokens, **kwargs))
        assert ids(results[0]) == ids(results[1])
        assert self.tables(req) is not None
        return ids(results[0])

    def tables(self, req):
        tables = [m.get_block_ids(req.request_id) for m in self.managers]
        assert tables[0] == tables[1]
        return tables[0]

    def call(self, name, *args):
        results = [getattr(m, name)(*args) for m in self.managers]
        assert results[0] == results[1], name
        return results[0]

    def free_order(self):
        orders = [free_order(m) for m in self.managers]
        assert orders[0] == orders[1]
        return orders[0]

    def events(self):
        events = [m.take_events() for m in self.managers]
        assert all(type(e).__module__ == vllm_events.__name__ for e in events[1])
        assert events[0] == events[1]
        return events[0]


def decode(pair, req, token, **kwargs):
    req.append_output_token_ids(token)
    new = pair.allocate(req, 1, **kwargs)
    req.num_computed_tokens += 1
    return new


def test_prefix_hits_frees_and_events_match_vllm():
    pair = Pair(*both(11, full(16)))
    common = [i for i in range(3) for _ in range(16)]
    a = request("a", common + [7] * 7, 16)
    assert pair.lookup(a) == (([],), 0)
    assert pair.allocate(a, 55, with_hit=True) == ([1, 2, 3, 4],)
    a.status = RequestStatus.RUNNING
    a.num_computed_tokens = 55
    b = request("b", common + [8] * 5, 16)
    assert pair.lookup(b) == (([1, 2, 3],), 48)
    assert pair.allocate(b, 5, with_hit=True) == ([5],)
    # b's hit blocks are already cached, its tail block is not full: one event, a's.
    [stored_a] = pair.events()
    assert isinstance(stored_a, vllm_events.BlockStored) and len(stored_a.block_hashes) == 3
    for token in range(9):
        decode(pair, a, 100 + token)
    pair.call("free", a)
    pair.call("free", b)
    assert pair.free_order() == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    c = request("c", list(range(160)), 16)
    pair.lookup(c)
    assert pair.allocate(c, 160, with_hit=True) == ([5, 6, 7, 8, 9, 10, 4, 3, 2, 1],)
    removed = pair.events()
    assert {type(event) for event in removed} == {
        vllm_events.BlockStored,
        vllm_events.BlockRemoved,
    }
    stats = [m.make_prefix_cache_stats() for m in pair.managers]
    assert isinstance(stats[1], PrefixCacheStats) and stats[0] == stats[1]


@pytest.mark.parametrize("retention", [None, 0, 32])
@pytest.mark.parametrize("use_eagle", [False, True])
def test_sliding_window_retention_and_eagle_match_vllm(retention, use_eagle):
    pair = Pair(
        *both(40, full(16), swa(4, 4), retention=retention, use_eagle=use_eagle, log_stats=False)
    )
    a = request("a", range(70), 4)
    pair.allocate(a, 70)
    a.num_computed_tokens = 70
    for token in range(12):
        decode(pair, a, 1000 + token)
    pair.call("free", a)
    pair.free_order()
    pair.lookup(request("b", list(range(70)) + [5, 5, 5], 4))
    pair.lookup(request("c", range(70), 4))


def test_mamba_align_with_speculative_blocks_matches_vllm():
    pair = Pair(*both(30, full(4), mamba(4, num_speculative_blocks=2), log_stats=False))
    a = request("a", range(13), 4)
    pair.allocate(a, 8)
    a.num_computed_tokens = 8
    pair.call("new_step_starts")
    pair.allocate(a, 5, num_lookahead_tokens=2)
    a.num_computed_tokens = 13
    for token in range(3):
        decode(pair, a, 100 + token, num_lookahead_tokens=2)
    b = request("b", range(20), 4)
    pair.lookup(b)
    pair.allocate(b, 8, with_hit=True)
    pair.call("free", a)
    pair.free_order()


def test_flat_mamba_shapes_build_and_match_vllm():
    # vLLM's tests write `shapes=(1, 1)` (one dtype): vLLM's manager never reads the page size
    # (its own page_size_bytes raises TypeError on it); pagedkv reads the ints as 1-d shapes.
    flat = MambaSpec(block_size=4, shapes=(1, 1), dtypes=(torch.float32,), mamba_cache_mode="align")
    reference, pagedkv = both(20, full(4), flat, log_stats=False)
    spec = pagedkv.core.kv_cache_config.kv_cache_groups[1].kv_cache_spec
    assert (spec.shapes, spec.page_size_bytes) == (((1,),), 4)
    pair = Pair(reference, pagedkv)
    a = request("a", range(10), 4)
    assert pair.allocate(a, 10) == ([1, 2, 3], [0, 0, 4])
    a.num_computed_tokens = 10
    pair.call("free", a)
    assert pair.lookup(request("b", range(10), 4)) == (([], []), 0)


@pytest.mark.parametrize("retention", [None, 0])
def test_mamba_prefill_checkpoint_matches_vllm(retention):
    # One 104-token chunk ends mid-block: the checkpoint keeps the state at 96 (the prompt's
    # reusable boundary) in column 2, so a resend resumes there instead of at 0.
    checkpointed = MambaSpec(
        block_size=32,
        shapes=((4, 8),),
        dtypes=(DTYPE,),
        mamba_cache_mode="align",
        num_prefill_checkpoint_blocks=1,
        prefill_checkpoint_alignment=16,
    )
    pair = Pair(*both(30, full(32), checkpointed, retention=retention, log_stats=False))
    a = request("a", range(104), 32)
    assert pair.allocate(a, 104) == ([1, 2, 3, 4], [0, 0, 5, 6])
    assert pair.managers[1].coordinator.single_type_managers[1]._checkpoints == {"a": (96, 2)}
    a.num_computed_tokens = 104
    pair.call("new_step_starts")
    decode(pair, a, 500)
    assert pair.tables(a) == ([1, 2, 3, 4], [0, 0, 0, 6])
    pair.call("free", a)
    pair.free_order()
    assert pair.lookup(request("b", range(104), 32)) == (([1, 2, 3], [0, 0, 5]), 96)
    # A two-chunk prefill: only the chunk reaching the prompt's end checkpoints under
    # retention 0; dense retention keeps the first chunk's too (its state at 32).
    c = request("c", [9] * 200, 32)
    pair.allocate(c, 64)
    first = pair.managers[1].coordinator.single_type_managers[1]._checkpoints.get("c")
    assert first == (None if retention == 0 else (32, 0))
    c.num_computed_tokens = 64
    pair.call("new_step_starts")
    pair.allocate(c, 136)
    pair.free_order()
    pair.events()


def test_hash_lookahead_events_match_vllm():
    pair = Pair(*both(20, full(4), num_hash_lookahead_tokens=2, log_stats=False))
    a = request("a", range(18), 4, lookahead=2)
    pair.allocate(a, 18)
    [stored] = pair.events()
    assert stored.lookahead_token_ids == [[4, 5], [8, 9], [12, 13], [16, 17]]
    a.num_computed_tokens = 18
    for token in range(100, 106):
        decode(pair, a, token)
        pair.events()


def test_vllm_code_sees_vllm_manager_kinds():
    _, pagedkv = both(20, full(4), log_stats=False)
    assert pagedkv.coordinator.single_type_managers[0].kv_cache_spec.block_size == 4
    assert not isinstance(pagedkv.coordinator.single_type_managers[0], CrossAttentionManager)
    assert pagedkv.get_num_common_prefix_blocks("x") == [0]
    assert pagedkv.take_kv_cache_block_copies() == ([], [])


def test_unsupported_layouts_are_refused_at_construction():
    def config(spec):
        group = KVCacheGroupSpec(["layer0"], spec)
        return KVCacheConfig(num_blocks=20, kv_cache_tensors=[], kv_cache_groups=[group])

    encoder_only = EncoderOnlyAttentionSpec(block_size=4, num_kv_heads=1, head_size=8, dtype=DTYPE)
    with pytest.raises(ConfigError, match="encoder-only attention groups"):
        PagedKVCacheManager(config(encoder_only), 64, 4, 4)
    # Decode context parallelism: a sharded block covers block_size * dcp tokens, which the
    # scheduler block must be a multiple of (vLLM does not check it; its scheduler passes one).
    with pytest.raises(ConfigError, match="block size 8 does not divide scheduler_block_size 4"):
        PagedKVCacheManager(config(full(4)), 64, 4, 4, dcp_world_size=2)
    sharded = PagedKVCacheManager(config(full(4)), 64, 8, 8, dcp_world_size=2)
    assert sharded.coordinator.single_type_managers[0].block_size == 8


def test_scheduler_class_picks_the_async_variant_and_restores_vllms_module():
    from vllm.v1.core.sched import scheduler as vllm_scheduler

    config = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=True))
    assert type(Scheduler.__new__(Scheduler, config)) is AsyncScheduler
    config.scheduler_config.async_scheduling = False
    assert type(Scheduler.__new__(Scheduler, config)) is Scheduler
    original = vllm_scheduler.KVCacheManager
    with manager_class_in_vllm_scheduler(PagedKVCacheManager):
        assert vllm_scheduler.KVCacheManager is PagedKVCacheManager
    assert vllm_scheduler.KVCacheManager is original


def test_events_travel_through_vllms_encoder_and_back_into_pagedkv():
    msgspec = pytest.importorskip("msgspec")
    from pagedkv.wire import EventDecoder

    _, pagedkv = both(20, full(4), log_stats=False)
    a = request("a", range(18), 4)
    pagedkv.allocate_slots(a, 18)
    events = pagedkv.take_events()
    payload = msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=1.5, events=events))
    decoded = EventDecoder().decode(payload)
    assert decoded.ts == 1.5 and len(decoded.events) == 1
    stored = decoded.events[0]
    assert stored.block_hashes == events[0].block_hashes
    assert stored.token_ids == list(range(16)) and stored.extra_keys == [None] * 4


def test_one_view_per_request_shares_its_lists_and_follows_it():
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    from pagedkv import RequestStatus as PagedKVStatus
    from pagedkv.integrations.vllm.requests import sync_view

    req = request("a", range(20), 4)
    view = sync_view(req, 4)
    assert view.all_token_ids is req._all_token_ids and view.block_hashes is req.block_hashes
    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
    req.num_computed_tokens = 8
    req.append_output_token_ids(5)
    assert sync_view(req, 4) is view
    assert (view.status, view.num_computed_tokens, view.num_tokens) == (
        PagedKVStatus.WAITING,
        8,
        21,
    )
    # A streaming session appends a multimodal item: the same view, its keys updated.
    req.mm_features.append(
        MultiModalFeatureSpec(
            data=None, modality="image", identifier="img", mm_position=PlaceholderRange(4, 8)
        )
    )
    assert sync_view(req, 4) is view
    assert [(f.identifier, f.offset, f.length) for f in view.mm_features] == [("img", 4, 8)]
    req.status = RequestStatus.FINISHED_ABORTED
    assert sync_view(req, 4).status.name.startswith("FINISHED")
