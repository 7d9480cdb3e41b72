"""Stateful property test: random interleavings of everything a scheduler does to the manager.

After every step `check_invariants()` must pass (counting blocks popped for a deferred free),
usage must stay in [0, 1], and a failed allocation must leave the state exactly as it was.
Freeing everything must return all `num_blocks - 1` blocks.
"""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ForeignBlockError,
    RequestStatus,
)
from pagedkv.specs import cdiv
from tests.support.builders import make_manager, make_request, snapshot

NUM_BLOCKS = 12
BLOCK_SIZE = 4
MAX_MODEL_LEN = 48
# A few shared prefixes so lookups hit often.
PREFIXES = [[], [1] * 8, [1] * 8 + [2] * 4, list(range(10, 22)), [3] * 16]

STEPS_RUN = [0]


class KVCacheMachine(RuleBasedStateMachine):
    # The eviction policy (pagedkv.eviction.EvictionConfig); None: the reference's plain LRU.
    # tests/eviction/test_property.py runs this machine once per policy.
    EVICTION = None

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(
            NUM_BLOCKS,
            BLOCK_SIZE,
            max_model_len=MAX_MODEL_LEN,
            enable_kv_cache_events=True,
            log_stats=True,
            eviction=self.EVICTION,
        )
        self.ids = itertools.count()
        self.waiting: list = []  # new or preempted: hold no blocks
        self.running: list = []  # hold blocks
        self.popped: list[list] = []  # blocks popped for a deferred free

    # ------------------------------------------------------------------ helpers

    def held_outside(self):
        return [block for blocks in self.popped for block in blocks]

    def preempt(self, req) -> None:
        self.manager.free(req)
        self.running.remove(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.waiting.insert(0, req)

    def check_table(self, req, num_lookahead_tokens: int) -> None:
        blocks = self.manager.get_blocks(req.request_id).blocks[0]
        need = min(req.num_computed_tokens + num_lookahead_tokens, MAX_MODEL_LEN)
        # Tables never shrink, so they cover at least this step's slots, and never pass
        # max_model_len.
        assert cdiv(need, BLOCK_SIZE) <= len(blocks) <= cdiv(MAX_MODEL_LEN, BLOCK_SIZE)
        # Every full, computed block of the request is cached under its own hash.
        num_cached = self.manager.coordinator.single_type_managers[0].num_cached_block.get(
            req.request_id, 0
        )
        for index in range(num_cached):
            # Cached when full; evict_blocks may have dropped the entry since.
            assert blocks[index].block_hash in (req.block_hashes[index], None)
            assert blocks[index].ref_cnt >= 1

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: len(self.waiting) < 6)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 5), min_size=1, max_size=20),
        skip_read=st.booleans(),
    )
    def add_request(self, prefix, suffix, skip_read):
        tokens = (prefix + suffix)[: MAX_MODEL_LEN - 4]
        req = make_request(
            f"r{next(self.ids)}",
            tokens,
            BLOCK_SIZE,
            max_tokens=8,
            skip_reading_prefix_cache=skip_read and len(self.waiting) % 3 == 0,
        )
        self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def lookup_changes_nothing(self, data):
        req = data.draw(st.sampled_from(self.waiting))
        before = snapshot(self.manager)
        hits, num_hit_tokens, boundary = self.manager.get_computed_blocks(req)
        assert snapshot(self.manager) == before
        assert boundary == 0
        assert num_hit_tokens % BLOCK_SIZE == 0 and num_hit_tokens <= req.num_tokens - 1
        blocks = hits.blocks[0]
        assert len(blocks) * BLOCK_SIZE == num_hit_tokens
        for index, block in enumerate(blocks):
            assert block.block_hash == req.block_hashes[index]

    @precondition(lambda self: self.waiting)
    @rule(
        data=st.data(),
        chunk=st.integers(1, 40),
        lookahead=st.integers(0, 3),
        must_fit=st.booleans(),
        reserved=st.integers(0, 2),
        delay=st.booleans(),
    )
    def admit(self, data, chunk, lookahead, must_fit, reserved, delay):
        req = data.draw(st.sampled_from(self.waiting))
        manager = self.manager
        hits, num_hit_tokens, _ = manager.get_computed_blocks(req)
        num_new = min(chunk, req.num_tokens - num_hit_tokens)
        before = snapshot(manager)
        new_blocks = manager.allocate_slots(
            req,
            num_new,
            num_hit_tokens,
            hits,
            num_lookahead_tokens=lookahead,
            delay_cache_blocks=delay,
            full_sequence_must_fit=must_fit,
            reserved_blocks=reserved,
            has_scheduled_reqs=bool(self.running),
        )
        if new_blocks is None:
            assert snapshot(manager) == before
            return
        assert all(block.ref_cnt == 1 for block in new_blocks.blocks[0])
        table = manager.get_block_ids(req.request_id)[0]
        assert table[: len(hits.blocks[0])] == [b.block_id for b in hits.blocks[0]]
        assert table[len(table) - len(new_blocks.blocks[0]) :] == new_blocks.get_block_ids()[0]
        manager.record_prefix_cache_stats(req, num_hit_tokens)
        req.num_computed_tokens = num_hit_tokens + num_new
        req.status = RequestStatus.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        self.check_table(req, lookahead)
        if delay:
            manager.cache_blocks(req, req.num_computed_tokens)

    @precondition(lambda self: len(self.waiting) >= 2)
    @rule(data=st.data(), evict_a_hit=st.booleans())
    def admit_with_stale_lookup(self, data, evict_a_hit):
        """Look A up, admit B (which may evict A's hits), then allocate A with the old result.

        With `evict_a_hit`, one of A's hit blocks also loses its cache entry in between (as
        after a failed KV load), so the old result must be refused.
        """
        first, second = data.draw(st.permutations(self.waiting))[:2]
        manager = self.manager
        hits, num_hit_tokens, _ = manager.get_computed_blocks(first)
        if evict_a_hit and hits.blocks[0]:
            victim = data.draw(st.sampled_from(hits.blocks[0]))
            manager.evict_blocks({victim.block_id})
        new_blocks = manager.allocate_slots(second, second.num_tokens)
        if new_blocks is not None:
            second.num_computed_tokens = second.num_tokens
            second.status = RequestStatus.RUNNING
            self.waiting.remove(second)
            self.running.append(second)
        still_valid = all(
            block.block_hash == first.block_hashes[index]
            for index, block in enumerate(hits.blocks[0])
        )
        before = snapshot(manager)
        try:
            result = manager.allocate_slots(
                first, first.num_tokens - num_hit_tokens, num_hit_tokens, hits
            )
        except ForeignBlockError as exc:
            assert not still_valid, exc
            assert snapshot(manager) == before
            return
        assert still_valid
        if result is None:
            assert snapshot(manager) == before
            return
        first.num_computed_tokens = first.num_tokens
        first.status = RequestStatus.RUNNING
        self.waiting.remove(first)
        self.running.append(first)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 16), lookahead=st.integers(0, 3))
    def step(self, data, chunk, lookahead):
        """One scheduler step for a running request: a prefill chunk or a decode token."""
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens < req.num_tokens:
            num_new = min(chunk, req.num_tokens - req.num_computed_tokens)
        elif req.num_tokens < MAX_MODEL_LEN:
            req.append_output_token_ids(data.draw(st.integers(0, 5)))
            num_new = 1
        else:
            self.finish_request(req)
            return
        before = snapshot(self.manager)
        new_blocks = self.manager.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
        if new_blocks is None:
            assert snapshot(self.manager) == before
            self.preempt(req)
            return
        req.num_computed_tokens += num_new
        self.check_table(req, lookahead)

    @precondition(lambda self: self.running)
    @rule(token=st.integers(0, 5))
    def decode_batch(self, token):
        """One batched decode step for every running request whose prompt is done."""
        batch = [
            r
            for r in self.running
            if r.num_computed_tokens == r.num_tokens and r.num_tokens < MAX_MODEL_LEN
        ]
        for req in batch:
            req.append_output_token_ids(token)
        num_allocated, with_new_blocks = self.manager.allocate_decode_slots(batch)
        assert set(map(id, with_new_blocks)) <= set(map(id, batch[:num_allocated]))
        for req in batch[:num_allocated]:
            req.num_computed_tokens += 1
            self.check_table(req, 0)
        # Requests from the first misfit on got no slot: their new token stays uncomputed,
        # and a later `step` (or a preemption) deals with it.

    def finish_request(self, req) -> None:
        self.manager.free(req)
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_STOPPED

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        self.finish_request(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt_running(self, data):
        self.preempt(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def pop_for_deferred_free(self, data):
        req = data.draw(st.sampled_from(self.running))
        num_held = len(self.manager.get_block_ids(req.request_id)[0])
        blocks = self.manager.pop_blocks_for_free(req)
        assert len(blocks) == num_held
        assert self.manager.get_block_ids(req.request_id) == ([],)
        self.running.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self.popped.append(blocks)

    @precondition(lambda self: self.popped)
    @rule(data=st.data())
    def release_popped(self, data):
        index = data.draw(st.integers(0, len(self.popped) - 1))
        self.manager.block_pool.free_blocks(reversed(self.popped.pop(index)))

    @precondition(lambda self: self.manager.block_pool.num_cached_blocks() > 0)
    @rule(block_ids=st.sets(st.integers(0, NUM_BLOCKS - 1), max_size=4))
    def evict(self, block_ids):
        free_before = self.manager.block_pool.free_block_ids()
        refs_before = [b.ref_cnt for b in self.manager.block_pool.blocks]
        self.manager.evict_blocks(block_ids)
        if self.manager.block_pool.eviction_policy is None:
            assert self.manager.block_pool.free_block_ids() == free_before
        else:
            # A policy moves an uncached free block to the reuse-first unhashed blocks.
            assert sorted(self.manager.block_pool.free_block_ids()) == sorted(free_before)
        assert [b.ref_cnt for b in self.manager.block_pool.blocks] == refs_before
        for block_id in block_ids:
            assert self.manager.block_pool.blocks[block_id].block_hash is None

    @precondition(lambda self: self.manager.block_pool.num_cached_blocks() > 0)
    @rule()
    def reset(self):
        pool = self.manager.block_pool
        all_free = pool.get_num_free_blocks() == NUM_BLOCKS - 1
        before = snapshot(self.manager)
        assert self.manager.reset_prefix_cache() is all_free
        if all_free:
            assert pool.num_cached_blocks() == 0
            assert all(block.block_hash is None for block in pool.blocks)
        else:
            assert snapshot(self.manager) == before

    @precondition(lambda self: self.manager.block_pool.kv_event_queue)
    @rule()
    def take_events(self):
        for event in self.manager.take_events():
            assert type(event) in (BlockStored, BlockRemoved, AllBlocksCleared)
            if type(event) is BlockStored:
                assert event.kv_cache_spec_kind == "full_attention"
                assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
        assert self.manager.take_events() == []

    @precondition(lambda self: self.manager.prefix_cache_stats.requests > 0)
    @rule()
    def take_stats(self):
        stats = self.manager.make_prefix_cache_stats()
        assert 0 <= stats.hits <= stats.queries
        assert 0 <= stats.preempted_hits <= stats.preempted_queries

    @precondition(lambda self: len(self.running) >= 3)
    @rule()
    def free_everything(self):
        for req in list(self.running):
            self.finish_request(req)
        while self.popped:
            self.manager.block_pool.free_blocks(reversed(self.popped.pop()))
        self.assert_all_free()

    def assert_all_free(self):
        pool = self.manager.block_pool
        assert pool.get_num_free_blocks() == NUM_BLOCKS - 1
        assert sorted(pool.free_block_ids()) == list(range(1, NUM_BLOCKS))
        assert self.manager.usage == 0.0
        assert all(block.ref_cnt == 0 for block in pool.blocks)

    # ------------------------------------------------------------------ invariants

    @invariant()
    def invariants_hold(self):
        STEPS_RUN[0] += 1
        self.manager.check_invariants(held_outside=self.held_outside())
        assert 0.0 <= self.manager.usage <= 1.0
        held = {
            b.block_id
            for r in self.running
            for b in self.manager.get_blocks(r.request_id).blocks[0]
        }
        held |= {b.block_id for b in self.held_outside()}
        assert len(held) + self.manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1

    def teardown(self):
        self.free_everything()
        self.manager.check_invariants()


def test_random_interleavings_keep_invariants():
    STEPS_RUN[0] = 0
    run_state_machine_as_test(
        KVCacheMachine,
        settings=settings(
            max_examples=80,
            stateful_step_count=50,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    # The invariant runs once before the first step and after every step.
    assert STEPS_RUN[0] >= 2000, STEPS_RUN[0]
