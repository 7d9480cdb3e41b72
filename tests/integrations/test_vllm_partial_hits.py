"""Sub-block (partial) hash hits against vLLM 0.33's own manager, call for call (issue 23): a
hybrid Mamba "align" model whose Mamba blocks are larger than a hash block. The same scenario
runs on vLLM's `KVCacheManager` and on the drop-in (pagedkv's core behind it), and every
observable is compared: hit lengths and blocks, tables, new blocks, the copies and their
retained ends, events, boundary-state offers, the free queue. Needs the `[vllm]` extra
(`.ci/vllm-suites` runs it in its vLLM venv; skipped elsewhere)."""

from __future__ import annotations

import math

import pytest

vllm = pytest.importorskip("vllm", reason="no vLLM in this venv: .ci/vllm-suites runs this")
torch = pytest.importorskip("torch")

from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager as VllmKVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from pagedkv.integrations.vllm import PagedKVCacheManager  # noqa: E402

init_none_hash(sha256)
DTYPE = torch.float32


def full(block_size):
    return FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=DTYPE)


def mamba(block_size):
    return MambaSpec(
        block_size=block_size, shapes=(1, 1), dtypes=(DTYPE,), mamba_cache_mode="align"
    )


def make(cls, num_blocks, specs, hash_block_size, dcp_world_size=1, **kwargs):
    groups = [KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)]
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    scaled = [spec.block_size * (dcp_world_size if spec.dcp_sharded else 1) for spec in specs]
    return cls(
        config,
        max_model_len=8192,
        dcp_world_size=dcp_world_size,
        scheduler_block_size=math.lcm(*scaled),
        hash_block_size=hash_block_size,
        enable_caching=True,
        enable_kv_cache_events=True,
        **kwargs,
    )


def request(request_id, tokens, hash_block_size):
    return Request(
        request_id,
        list(tokens),
        SamplingParams(max_tokens=100),
        None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256, 0),
    )


def event_summary(manager):
    """The events as comparable tuples (vLLM's events carry hashes as ints, both sides)."""
    return [
        (
            type(event).__name__,
            getattr(event, "group_idx", None),
            getattr(event, "block_size", None),
            list(getattr(event, "token_ids", None) or []),
            list(getattr(event, "block_hashes", None) or []),
            getattr(event, "parent_block_hash", None),
        )
        for event in manager.take_events()
    ]


def free_queue(manager):
    return [block.block_id for block in manager.block_pool.free_block_queue.get_all_free_blocks()]


def step(manager, req, num_new_tokens, transcript, *, lookup=True):
    """One scheduling of `req`: lookup (first time), allocate, copies, offers; advance."""
    manager.new_step_starts()
    num_hit = 0
    hits = None
    if lookup:
        hits, num_hit, _ = manager.get_computed_blocks(req)
        transcript.append(("hit", num_hit, hits.get_block_ids()))
    new = manager.allocate_slots(req, num_new_tokens, num_hit, hits)
    transcript.append(("new", None if new is None else new.get_block_ids()))
    copies, retained = manager.take_kv_cache_block_copies()
    transcript.append(("copies", [tuple(c) for c in copies], [b.block_id for b in retained]))
    transcript.append(("offers", manager.take_boundary_state_offloads()))
    transcript.append(("table", manager.get_block_ids(req.request_id)))
    if new is not None:
        req.num_computed_tokens = num_hit + num_new_tokens
    # The worker ran the step, copies included: the scheduler releases their ends.
    manager.block_pool.free_blocks(retained)
    return num_hit


def run_both(scenario, *args):
    transcripts = []
    for cls in (VllmKVCacheManager, PagedKVCacheManager):
        transcript = []
        scenario(cls, transcript, *args)
        transcripts.append(transcript)
    return transcripts


def consumer_scenario(cls, transcript, mamba_block_size, dcp_world_size=1):
    # A producer prefills 6 of 7 tokens and finishes; a longer sibling hits 6 tokens, inside
    # a Mamba block: its state is copied into a private block. (Under decode context
    # parallelism the full-attention blocks cover 2 * dcp tokens and the hit ends in them.)
    manager = make(cls, 24, [full(2), mamba(mamba_block_size)], 2, dcp_world_size)
    producer = request("p", [0, 0, 1, 1, 2, 2, 3], 2)
    step(manager, producer, 6, transcript)
    transcript.append(("events", event_summary(manager)))
    manager.free(producer)
    consumer = request("c", [0, 0, 1, 1, 2, 2, 3, 3, 4, 4], 2)
    step(manager, consumer, 4, transcript)
    transcript.append(("events", event_summary(manager)))
    consumer.append_output_token_ids([9])
    step(manager, consumer, 1, transcript, lookup=False)
    manager.free(consumer)
    transcript.append(("events", event_summary(manager)))
    transcript.append(("free", free_queue(manager)))


def producer_scenario(cls, transcript, chunk):
    # A request whose first chunk ends at its prompt's tail boundary inside a Mamba block: it
    # enters that state, then goes on writing into the same block; the cache keeps a copy.
    manager = make(cls, 30, [full(2), mamba(8)], 2)
    req = request("p", range(13), 2)
    step(manager, req, chunk, transcript)
    step(manager, req, 13 - chunk, transcript, lookup=False)
    transcript.append(("events", event_summary(manager)))
    sibling = request("s", [*range(12), 50, 51], 2)
    step(manager, sibling, 2, transcript)
    transcript.append(("events", event_summary(manager)))
    manager.free(req)
    manager.free(sibling)
    transcript.append(("free", free_queue(manager)))


def eviction_scenario(cls, transcript):
    # A small pool: blocks with a sub-block entry and a full one are evicted with both keys.
    manager = make(cls, 9, [full(2), mamba(4)], 2)
    for request_id, offset in (("a", 0), ("b", 100), ("c", 200)):
        req = request(request_id, range(offset, offset + 7), 2)
        step(manager, req, 6, transcript)
        req.append_output_token_ids([1])
        step(manager, req, 1, transcript, lookup=False)
        manager.free(req)
        transcript.append(("events", event_summary(manager)))
        transcript.append(("free", free_queue(manager)))


def full_attention_tail_scenario(cls, transcript):
    # Full attention with blocks of 4 tokens over hash blocks of 2: the prompt's tail boundary
    # is entered inside a block and a sibling's hit ends there (copied, as Mamba's).
    manager = make(cls, 30, [full(4), mamba(8)], 2)
    producer = request("p", range(11), 2)
    step(manager, producer, 10, transcript)  # the chunk ends at the prompt's tail boundary
    step(manager, producer, 1, transcript, lookup=False)
    transcript.append(("events", event_summary(manager)))
    manager.free(producer)
    sibling = request("s", [*range(10), 70, 71, 72], 2)
    step(manager, sibling, 3, transcript)
    transcript.append(("events", event_summary(manager)))
    manager.free(sibling)
    transcript.append(("free", free_queue(manager)))


@pytest.mark.parametrize("mamba_block_size", [4, 8])
def test_a_hit_inside_a_mamba_block_is_copied_like_vllms(mamba_block_size):
    reference, paged = run_both(consumer_scenario, mamba_block_size)
    assert paged == reference
    hit = next(entry for entry in paged if entry[0] == "hit" and entry[1])
    assert hit[1] == 6  # three hash blocks, inside the Mamba block
    copies = [entry for entry in paged if entry[0] == "copies" and entry[1]]
    assert len(copies) == 1 and len(copies[0][2]) == 2


def test_sub_block_hits_under_decode_context_parallelism_are_vllms():
    # Full attention sharded over 4 ranks (8-token blocks), Mamba replicated at 2 tokens: the
    # 6-token hit ends inside a full-attention block, which is copied.
    reference, paged = run_both(consumer_scenario, 2, 4)
    assert paged == reference
    assert next(entry for entry in paged if entry[0] == "hit" and entry[1])[1] == 6
    assert [entry[1] for entry in paged if entry[0] == "copies" and entry[1]] != []


@pytest.mark.parametrize("chunk", [12, 10, 6])
def test_a_producer_keeps_writing_and_the_cache_keeps_a_copy_like_vllms(chunk):
    reference, paged = run_both(producer_scenario, chunk)
    assert paged == reference


def test_blocks_with_several_keys_are_evicted_like_vllms():
    reference, paged = run_both(eviction_scenario)
    assert paged == reference
    removed = [
        e for entry in paged if entry[0] == "events" for e in entry[1] if e[0] == "BlockRemoved"
    ]
    assert removed  # the small pool evicted cached blocks


def test_full_attention_sub_block_hits_are_vllms():
    reference, paged = run_both(full_attention_tail_scenario)
    assert paged == reference
    hits = [entry[1] for entry in paged if entry[0] == "hit"]
    assert hits == [0, 10]  # inside the third full-attention block and the second Mamba one
    copies = [entry[1] for entry in paged if entry[0] == "copies" and entry[1]]
    assert len(copies) == 2 and len(copies[1]) == 2  # the producer's own tail; both groups


def test_partial_hits_are_off_where_a_group_cannot_look_up_finely():
    # A sliding-window group with blocks larger than a hash block needs block-aligned hits.
    specs = [full(2), SlidingWindowSpec(block_size=4, num_kv_heads=1, head_size=1,
                                        dtype=DTYPE, sliding_window=8), mamba(8)]  # fmt: skip
    flags = [
        make(cls, 30, specs, 2).coordinator.enable_partial_hash_hits
        for cls in (VllmKVCacheManager, PagedKVCacheManager)
    ]
    assert flags == [False, False]
    flags = [
        make(cls, 30, [full(2), mamba(8)], 2).coordinator.enable_partial_hash_hits
        for cls in (VllmKVCacheManager, PagedKVCacheManager)
    ]
    assert flags == [True, True]
