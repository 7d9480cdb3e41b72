"""The running-request fast paths equal the general path, on random hybrid workloads.

Two managers of one configuration run the same random scheduler operations in lockstep. On
`fast`, running requests allocate with plain `allocate_slots(request, n)` and
`allocate_decode_slots` (the running allocators); on `general`, the same calls pass
`new_computed_blocks=manager.empty_kv_cache_blocks`, which means the same (no hits) but takes
the general, stage-by-stage path. `fast` frees with `free(request)`; `general` pops the blocks
and frees each group's table in reverse, as the coordinator's `free` does. After every
operation both must hold the same block tables, free-queue order, prefix cache and events, and
pass `check_invariants()`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import KVCacheManager, Request, RequestStatus, make_request_block_hasher
from pagedkv.coordinators.running import (
    MultiGroupRunningAllocator,
    SingleGroupRunningAllocator,
)
from tests.support.builders import snapshot
from tests.support.hybrid import chunked, config, full, make_manager, swa

MAX_MODEL_LEN = 160
PREFIXES = [list(range(100, 140)), list(range(200, 224)), [7] * 30]

# name -> (manager builder, hash block size, expected allocator type)
CONFIGS: dict[str, tuple[Callable[[], KVCacheManager], int, type]] = {
    "gemma-like: full + 3 sliding windows": (
        lambda: make_manager(
            48, full(4), swa(4, 10), swa(4, 10), swa(4, 10), enable_kv_cache_events=True
        ),
        4,
        MultiGroupRunningAllocator,
    ),
    "llama4-like: full + chunked local": (
        lambda: make_manager(32, full(4), chunked(4, 12), enable_kv_cache_events=True),
        4,
        MultiGroupRunningAllocator,
    ),
    "two block sizes: full 8 + window 4 (alignment 8)": (
        lambda: make_manager(32, full(8), swa(4, 10), hash_block_size=4),
        4,
        MultiGroupRunningAllocator,
    ),
    "windows of two sizes": (
        lambda: make_manager(40, full(4), swa(4, 6), swa(4, 13), enable_kv_cache_events=True),
        4,
        MultiGroupRunningAllocator,
    ),
    "one sliding-window group": (
        lambda: make_manager(16, swa(4, 9), enable_kv_cache_events=True),
        4,
        MultiGroupRunningAllocator,
    ),
    "caching off: full + window": (
        lambda: make_manager(32, full(4), swa(4, 10), enable_caching=False),
        4,
        MultiGroupRunningAllocator,
    ),
    "sparse retention: window 5 under alignment 16 (vLLM 0.33 masks)": (
        lambda: make_manager(
            48, full(4), swa(4, 5), scheduler_block_size=16, enable_kv_cache_events=True
        ),
        4,
        MultiGroupRunningAllocator,
    ),
    "one full-attention group": (
        lambda: make_manager(16, full(4), enable_kv_cache_events=True),
        4,
        SingleGroupRunningAllocator,
    ),
}


def comparable(manager: KVCacheManager) -> dict:
    state = snapshot(manager)
    state["requests"] = sorted(state["requests"])
    return state


def ids(blocks) -> object:
    return None if blocks is None else blocks.get_block_ids()


class Lockstep:
    """One logical request stream on both managers (each has its own Request objects)."""

    def __init__(self, config: str) -> None:
        build, hash_block_size, allocator_type = CONFIGS[config]
        self.fast, self.general = build(), build()
        assert type(self.fast._running_allocator) is allocator_type
        self.hasher = make_request_block_hasher(hash_block_size)
        self.running: list[tuple[Request, Request]] = []
        self.waiting: list[tuple[Request, Request]] = []
        self.num_requests = 0

    def check(self) -> None:
        assert comparable(self.fast) == comparable(self.general)
        self.fast.check_invariants()
        self.general.check_invariants()

    def arrive(self, prefix: int, prefix_len: int, suffix: list[int], chunk: int) -> None:
        tokens = PREFIXES[prefix][:prefix_len] + suffix or [1]
        self.num_requests += 1
        pair = tuple(
            Request(f"r{self.num_requests}", tokens, block_hasher=self.hasher) for _ in range(2)
        )
        self.admit(pair, chunk)  # type: ignore[arg-type]

    def admit(self, pair: tuple[Request, Request], chunk: int) -> None:
        results = []
        for manager, request in zip((self.fast, self.general), pair, strict=True):
            hits, num_hit, _ = manager.get_computed_blocks(request)
            num_new = min(chunk, request.num_tokens - num_hit)
            blocks = manager.allocate_slots(request, num_new, num_hit, hits)
            results.append(ids(blocks))
            if blocks is not None:
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit + num_new
        assert results[0] == results[1]
        (self.running if results[0] is not None else self.waiting).append(pair)

    def step(self, chunk: int, token: int, delay: bool, in_flight: int) -> None:
        """Every running request: its next chunk, or one decode token once its prompt is done."""
        self.fast.new_step_starts()
        self.general.new_step_starts()
        for pair in list(self.running):
            if pair not in self.running:
                continue  # preempted earlier in this step
            fast_request, general_request = pair
            if fast_request.num_computed_tokens == fast_request.num_tokens:
                if fast_request.num_tokens >= MAX_MODEL_LEN - 1:
                    self.finish(pair)
                    continue
                for request in pair:
                    request.append_output_token_ids(token)
            for request in pair:
                request.num_in_flight_tokens = min(in_flight, request.num_computed_tokens)
            num_new = min(chunk, fast_request.num_tokens - fast_request.num_computed_tokens)
            got = self.fast.allocate_slots(fast_request, num_new, delay_cache_blocks=delay)
            want = self.general.allocate_slots(
                general_request,
                num_new,
                new_computed_blocks=self.general.empty_kv_cache_blocks,
                delay_cache_blocks=delay,
            )
            assert ids(got) == ids(want)
            assert (got is self.fast.empty_kv_cache_blocks) == (
                want is self.general.empty_kv_cache_blocks
            )
            if got is None:
                self.preempt(pair)
                continue
            for request in pair:
                request.num_computed_tokens += num_new
            if delay:  # the engine caches once the KV is in
                self.fast.cache_blocks(fast_request, fast_request.num_computed_tokens)
                self.general.cache_blocks(general_request, general_request.num_computed_tokens)

    def decode_batch(self, token: int) -> None:
        """`allocate_decode_slots` on one side, `allocate_slots(r, 1)` per request on the other."""
        pairs = [p for p in self.running if p[0].num_tokens < MAX_MODEL_LEN - 1]
        for pair in pairs:
            if pair[0].num_computed_tokens == pair[0].num_tokens:
                for request in pair:
                    request.append_output_token_ids(token)
        num_allocated, with_new = self.fast.allocate_decode_slots([p[0] for p in pairs])
        expected_new = []
        for index, (_, general_request) in enumerate(pairs):
            blocks = self.general.allocate_slots(
                general_request, 1, new_computed_blocks=self.general.empty_kv_cache_blocks
            )
            if blocks is None:
                assert num_allocated == index
                break
            if blocks is not self.general.empty_kv_cache_blocks:
                expected_new.append(general_request.request_id)
        else:
            assert num_allocated == len(pairs)
        assert [r.request_id for r in with_new] == expected_new
        for pair in pairs[:num_allocated]:
            for request in pair:
                request.num_computed_tokens += 1
        if num_allocated < len(pairs):
            self.preempt(pairs[num_allocated])

    def free(self, pair: tuple[Request, Request]) -> None:
        fast_request, general_request = pair
        self.fast.free(fast_request)
        lengths = [len(table) for table in self.general.get_block_ids(general_request.request_id)]
        blocks = self.general.pop_blocks_for_free(general_request)
        offset = 0
        for length in lengths:
            self.general.block_pool.free_blocks(reversed(blocks[offset : offset + length]))
            offset += length

    def preempt(self, pair: tuple[Request, Request]) -> None:
        self.free(pair)
        for request in pair:
            request.status = RequestStatus.PREEMPTED
            request.num_computed_tokens = 0
            request.num_in_flight_tokens = 0
        self.running.remove(pair)
        self.waiting.insert(0, pair)

    def finish(self, pair: tuple[Request, Request]) -> None:
        self.free(pair)
        for request in pair:
            request.status = RequestStatus.FINISHED_STOPPED
        self.running.remove(pair)


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("arrive"),
            st.integers(0, len(PREFIXES) - 1),
            st.integers(0, 40),
            st.lists(st.integers(0, 50), max_size=20),
            st.integers(1, 48),
        ),
        st.tuples(st.just("resume"), st.integers(1, 48)),
        st.tuples(
            st.just("step"),
            st.integers(1, 12),
            st.integers(0, 50),
            st.booleans(),
            st.integers(0, 6),
        ),
        st.tuples(st.just("decode_batch"), st.integers(0, 50)),
        st.tuples(st.just("finish"), st.integers(0, 15)),
        st.tuples(st.just("evict"), st.lists(st.integers(1, 47), max_size=3)),
    ),
    min_size=5,
    max_size=40,
)


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=40, deadline=None)
@given(ops=operations)
def test_fast_paths_equal_the_general_path(config, ops):
    lockstep = Lockstep(config)
    for op in ops:
        kind = op[0]
        if kind == "arrive":
            lockstep.arrive(*op[1:])
        elif kind == "resume" and lockstep.waiting:
            lockstep.admit(lockstep.waiting.pop(0), op[1])
        elif kind == "step":
            lockstep.step(*op[1:])
        elif kind == "decode_batch":
            lockstep.decode_batch(op[1])
        elif kind == "finish" and lockstep.running:
            lockstep.finish(lockstep.running[op[1] % len(lockstep.running)])
        elif kind == "evict":
            num_blocks = lockstep.fast.block_pool.num_gpu_blocks
            block_ids = {block_id for block_id in op[1] if block_id < num_blocks}
            # Only blocks nobody holds (a held block losing its hash breaks an invariant the
            # general path's checks rely on; see test_hybrid_stateful).
            held = {b.block_id for b in lockstep.fast.block_pool.blocks if b.ref_cnt}
            lockstep.fast.evict_blocks(block_ids - held)
            lockstep.general.evict_blocks(block_ids - held)
        lockstep.check()
    for pair in list(lockstep.running):
        lockstep.finish(pair)
    lockstep.check()


def test_configurations_without_a_replayable_manager_keep_the_general_path():
    from tests.support.hybrid import mamba

    manager = make_manager(32, full(8), mamba(8))
    assert manager._running_allocator is None


@pytest.mark.parametrize(
    ("kwargs", "interval"),
    [
        ({"use_eagle": True}, None),
        ({"num_prefill_lookahead": 2}, None),
        ({}, 32),
    ],
    ids=["EAGLE", "re-prefillable tokens", "retention interval"],
)
def test_configurations_the_fast_path_does_not_replay_take_the_general_path(kwargs, interval):
    # EAGLE's per-group cacheable tokens, re-prefillable tokens and a retention interval's
    # replay boundaries change the steps the running allocator replays: it must not be built.
    kv_cache_config = replace(
        config(48, full(4), swa(4, 5)), prefix_cache_retention_interval=interval
    )
    manager = KVCacheManager(
        kv_cache_config, max_model_len=MAX_MODEL_LEN, scheduler_block_size=16, **kwargs
    )
    assert manager._running_allocator is None
