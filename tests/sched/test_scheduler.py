"""Scenario tests of the reference scheduler: exact batches, block ids, preemptions."""

from __future__ import annotations

import random

import pytest

from pagedkv import (
    FullAttentionSpec,
    InvalidArgumentError,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    make_request_block_hasher,
)
from pagedkv.errors import ConfigError, RequestStateError
from pagedkv.sched import PriorityPolicy, Scheduler, SchedulerConfig
from tests.support.hybrid import config as hybrid_config
from tests.support.hybrid import full, mamba
from tests.support.hybrid import make_request as hybrid_request

BLOCK_SIZE = 4
HASHER = make_request_block_hasher(BLOCK_SIZE)


def make_manager(num_blocks: int, max_model_len: int = 24, **kwargs) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype_bytes=1)
    config = KVCacheConfig(num_blocks, (KVCacheGroupSpec(("layer.0",), spec),))
    return KVCacheManager(config, max_model_len, log_stats=True, **kwargs)


def make_request(request_id: str, tokens, max_tokens: int, **kwargs) -> Request:
    return Request(request_id, list(tokens), max_tokens=max_tokens, block_hasher=HASHER, **kwargs)


def sampled_for(output, base: int = 1000) -> dict[str, list[int]]:
    """One deterministic token for every request the step samples."""
    return {
        item.request_id: [base + item.request.num_output_tokens]
        for item in output.scheduled
        if item.is_prefill_chunk_complete
    }


def step(scheduler: Scheduler):
    output = scheduler.schedule()
    scheduler.check_invariants()
    finished = scheduler.update_from_output(output, sampled_for(output))
    scheduler.check_invariants()
    return output, finished


def batch(output) -> list[tuple[str, int, int, list[int]]]:
    return [
        (item.request_id, item.num_computed_tokens, item.num_scheduled_tokens, item.block_ids[0])
        for item in output.scheduled
    ]


def test_chunked_prefill_splits_a_long_prompt_across_steps():
    scheduler = Scheduler(make_manager(11, 40), SchedulerConfig(max_num_batched_tokens=8))
    request = make_request("long", range(20), max_tokens=2)
    scheduler.add_request(request)
    outputs = [step(scheduler)[0] for _ in range(4)]
    assert [batch(o) for o in outputs] == [
        [("long", 0, 8, [1, 2])],
        [("long", 8, 8, [1, 2, 3, 4])],
        [("long", 16, 4, [1, 2, 3, 4, 5])],
        [("long", 20, 1, [1, 2, 3, 4, 5, 6])],
    ]
    assert [o.scheduled[0].is_prefill_chunk_complete for o in outputs] == [False, False, True, True]
    assert [o.scheduled[0].new_block_ids for o in outputs] == [([1, 2],), ([3, 4],), ([5],), ([6],)]
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.output_token_ids == [1000, 1001]
    records = scheduler.step_records
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in records] == [
        (8, 0),
        (8, 0),
        (4, 0),
        (0, 1),
    ]
    assert [r.num_kv_tokens_read for r in records] == [8, 16, 20, 21]
    # Causal pairs: chunk [16, 20) attends 17 + 18 + 19 + 20 keys.
    assert records[2].num_prefill_attention_pairs == 17 + 18 + 19 + 20
    assert records[3].finished_request_ids == ("long",)
    assert not scheduler.has_unfinished_requests()


def test_long_prefill_threshold_caps_each_step():
    config = SchedulerConfig(max_num_batched_tokens=16, long_prefill_token_threshold=6)
    scheduler = Scheduler(make_manager(11, 40), config)
    scheduler.add_request(make_request("r", range(14), max_tokens=1))
    assert [step(scheduler)[0].num_scheduled_tokens_total for _ in range(3)] == [6, 6, 2]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    config = SchedulerConfig(max_num_batched_tokens=24, enable_chunked_prefill=False)
    scheduler = Scheduler(make_manager(11), config)
    scheduler.add_request(make_request("a", range(20), max_tokens=3))
    scheduler.add_request(make_request("b", range(100, 110), max_tokens=3))
    first, _ = step(scheduler)
    second, _ = step(scheduler)
    assert batch(first) == [("a", 0, 20, [1, 2, 3, 4, 5])]
    assert [(i.request_id, i.num_scheduled_tokens) for i in second.scheduled] == [
        ("a", 1),
        ("b", 10),
    ]


def test_preemption_by_recompute_and_readmission_with_a_prefix_hit():
    manager = make_manager(7)  # six usable blocks
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=16))
    a = make_request("A", range(8), max_tokens=10)
    b = make_request("B", range(100, 108), max_tokens=10)
    scheduler.add_request(a)
    scheduler.add_request(b)
    outputs = [step(scheduler)[0] for _ in range(6)]
    assert batch(outputs[0]) == [("A", 0, 8, [1, 2]), ("B", 0, 8, [3, 4])]
    assert batch(outputs[4]) == [("A", 11, 1, [1, 2, 5]), ("B", 11, 1, [3, 4, 6])]
    # Step 5: A needs a fourth block, none is free: the last running request (B) is preempted.
    # B's blocks are freed tail first, so A gets block 6 (B's third block).
    assert outputs[5].preempted_request_ids == ["B"]
    assert batch(outputs[5]) == [("A", 12, 1, [1, 2, 5, 6])]
    assert b.num_preemptions == 1
    assert manager.block_pool.free_block_ids() == [4, 3]
    outputs += [step(scheduler)[0] for _ in range(5)]
    # A needs a fifth block at step 9 and evicts block 4; then A finishes.
    assert batch(outputs[9]) == [("A", 16, 1, [1, 2, 5, 6, 4])]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    # Step 10: B comes back; its first block is still cached: a 4-token hit, recompute the rest
    # (prompt and its 5 earlier outputs), then it samples its sixth token.
    record = scheduler.step_records[10]
    assert (record.num_admitted, record.num_prefix_hit_tokens) == (1, 4)
    assert batch(outputs[10]) == [("B", 4, 9, [3, 4, 6, 5])]
    assert outputs[10].scheduled[0].is_prefill_chunk_complete
    assert b.output_token_ids == [1000, 1001, 1002, 1003, 1004, 1005]
    stats = manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 0)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 13, 4)


def test_no_admission_in_a_step_that_preempted():
    manager = make_manager(7)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=16), PriorityPolicy())
    scheduler.add_request(make_request("A", range(8), max_tokens=10, priority=0))
    scheduler.add_request(make_request("B", range(100, 108), max_tokens=10, priority=2))
    for _ in range(2):
        step(scheduler)  # A and B hold all six blocks after step 1
    scheduler.add_request(make_request("C", range(200, 203), max_tokens=2, priority=1))
    outputs = [step(scheduler)[0] for _ in range(4)]
    # C cannot fit until step 5, where B (lowest priority) is preempted; C, although it would
    # now fit, is admitted only in the next step.
    assert [o.preempted_request_ids for o in outputs] == [[], [], [], ["B"]]
    assert [i.request_id for i in outputs[3].scheduled] == ["A"]
    assert scheduler.step_records[-1].num_admitted == 0
    nxt, _ = step(scheduler)
    assert [(i.request_id, i.num_scheduled_tokens) for i in nxt.scheduled] == [("A", 1), ("C", 3)]


def test_priority_policy_preempts_the_lowest_priority_not_the_last():
    manager = make_manager(7)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=16), PriorityPolicy())
    low = make_request("low", range(8), max_tokens=10, priority=5, arrival_time=0.0)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(make_request("mid", range(100, 104), max_tokens=10, priority=1))
    scheduler.add_request(make_request("top", range(200, 204), max_tokens=10, priority=0))
    admitted, _ = step(scheduler)
    # Admission follows priority: top before mid; running order is low, top, mid.
    assert [i.request_id for i in admitted.scheduled] == ["low", "top", "mid"]
    preempting = None
    for _ in range(10):
        output, _ = step(scheduler)
        if output.preempted_request_ids:
            preempting = output
            break
    assert preempting is not None
    assert preempting.preempted_request_ids == ["low"]
    # `low` was scheduled earlier in the same step: its tokens and slot were given back.
    assert [i.request_id for i in preempting.scheduled] == ["top", "mid"]
    assert preempting.num_scheduled_tokens_total == 2
    assert low.status == RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert list(scheduler.waiting) == [low]


def test_priority_victim_that_is_the_request_itself_lets_the_requests_after_it_run():
    # 5 usable blocks of 4 tokens. `low` (7 prompt tokens, 2 blocks) runs first, then `top`
    # (8 tokens, 2 blocks) and `mid` (4 tokens, 1 block) fill the pool. Next step `low` needs a
    # third block, finds none and is its own victim (the lowest priority); as in vLLM's
    # scheduler, `top` and `mid` behind it still run in that step, in what `low` freed.
    manager = make_manager(6, max_model_len=20)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=16), PriorityPolicy())
    low = make_request("low", range(7), max_tokens=10, priority=5, arrival_time=0.0)
    scheduler.add_request(low)
    step(scheduler)
    scheduler.add_request(make_request("top", range(100, 108), max_tokens=10, priority=0))
    scheduler.add_request(make_request("mid", range(200, 204), max_tokens=10, priority=1))
    admitted, _ = step(scheduler)
    assert [(i.request_id, i.num_scheduled_tokens) for i in admitted.scheduled] == [
        ("low", 1),
        ("top", 8),
        ("mid", 4),
    ]
    assert manager.block_pool.get_num_free_blocks() == 0
    output, _ = step(scheduler)
    assert output.preempted_request_ids == ["low"]
    # `low`'s two cached blocks were freed tail first, so its tail block 2 is reused first.
    assert batch(output) == [("top", 8, 1, [3, 4, 2]), ("mid", 4, 1, [5, 1])]
    assert low.status == RequestStatus.PREEMPTED and list(scheduler.waiting) == [low]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_budget_and_max_num_seqs_hold_every_step(policy, seed):
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=3)
    manager = make_manager(17, max_model_len=48, watermark=0.1)
    scheduler = Scheduler(manager, config, PriorityPolicy() if policy == "priority" else None)
    shared = list(range(8))
    for index in range(30):
        prompt = shared[: rng.choice([0, 4, 8])] + [
            500 + 50 * index + i for i in range(rng.randint(1, 30))
        ]
        scheduler.add_request(
            make_request(
                f"r{index}",
                prompt,
                max_tokens=rng.randint(1, 12),
                priority=rng.randint(0, 3),
                arrival_time=float(index),
            )
        )
    num_steps = 0
    while scheduler.has_unfinished_requests():
        output, _ = step(scheduler)
        record = scheduler.step_records[-1]
        assert output.num_scheduled_tokens_total == sum(
            i.num_scheduled_tokens for i in output.scheduled
        )
        assert 0 < output.num_scheduled_tokens_total <= 24
        assert len(output.scheduled) <= 3
        assert record.num_running <= 3
        assert len({i.request_id for i in output.scheduled}) == len(output.scheduled)
        num_steps += 1
        assert num_steps < 2000
    assert manager.usage == 0.0


def test_fcfs_never_starves_a_request():
    rng = random.Random(7)
    manager = make_manager(13, max_model_len=40)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4))
    arrival_order = []
    first_scheduled: list[str] = []
    finished: list[str] = []
    num_steps = 0
    while len(finished) < 60:
        if len(arrival_order) < 60 and rng.random() < 0.7:
            request_id = f"r{len(arrival_order)}"
            prompt = [rng.randrange(10_000) for _ in range(rng.randint(1, 30))]
            scheduler.add_request(make_request(request_id, prompt, max_tokens=rng.randint(1, 8)))
            arrival_order.append(request_id)
        if scheduler.has_unfinished_requests():
            output, done = step(scheduler)
            for item in output.scheduled:
                if item.request_id not in first_scheduled:
                    first_scheduled.append(item.request_id)
            finished += [request.request_id for request in done]
        num_steps += 1
        assert num_steps < 3000
    assert sorted(finished) == sorted(arrival_order)
    assert first_scheduled == arrival_order  # admitted strictly in arrival order


def test_watermark_holds_blocks_back_from_admissions_only():
    for watermark, admitted in ((0.0, True), (0.3, False)):
        manager = make_manager(11, max_model_len=40, watermark=watermark)  # 3 watermark blocks
        scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=32))
        scheduler.add_request(make_request("a", range(8), max_tokens=5))
        step(scheduler)
        scheduler.add_request(make_request("b", range(100, 124), max_tokens=1))  # 6 blocks
        output, _ = step(scheduler)
        assert ("b" in [i.request_id for i in output.scheduled]) is admitted


def test_async_caching_caches_blocks_only_after_the_output():
    for async_caching in (False, True):
        manager = make_manager(11)
        scheduler = Scheduler(manager, SchedulerConfig(async_caching=async_caching))
        scheduler.add_request(make_request("a", range(9), max_tokens=3))
        scheduler.add_request(make_request("b", range(9), max_tokens=3))
        output = scheduler.schedule()
        # Sync: a's two full blocks are cached at allocation, so b already hits them.
        assert [i.num_computed_tokens for i in output.scheduled] == (
            [0, 0] if async_caching else [0, 8]
        )
        assert manager.block_pool.num_cached_blocks() == (0 if async_caching else 2)
        scheduler.update_from_output(output, sampled_for(output))
        # Async: both computed the shared prefix, both copies enter the cache (first one wins
        # lookups); sync: b reused a's blocks.
        cached = sorted(manager.block_pool.cached_hashes().values())
        assert cached == ([[1, 4], [2, 5]] if async_caching else [[1], [2]])
        scheduler.check_invariants()


def test_abort_anywhere_frees_everything():
    manager = make_manager(11)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=8))
    for name in ("a", "b", "c"):
        scheduler.add_request(make_request(name, range(12), max_tokens=4))
    output = scheduler.schedule()
    assert [i.request_id for i in output.scheduled] == ["a"]
    assert scheduler.abort_request("a")  # between schedule and update
    assert scheduler.abort_request("c")  # waiting
    assert not scheduler.abort_request("c")
    assert not scheduler.abort_request("nobody")
    # The aborted request's sampled ids are ignored; its blocks are already free.
    assert scheduler.update_from_output(output, {}) == []
    scheduler.check_invariants()
    output, _ = step(scheduler)
    assert [i.request_id for i in output.scheduled] == ["b"]
    assert scheduler.abort_request("b")  # running
    assert manager.usage == 0.0
    assert not scheduler.has_unfinished_requests()
    scheduler.check_invariants()


def test_stop_token_and_max_model_len_finish_requests():
    config = SchedulerConfig(max_num_batched_tokens=32, stop_token_ids=(1002,))
    scheduler = Scheduler(make_manager(11, max_model_len=20), config)
    stopped = make_request("stop", range(4), max_tokens=10)
    capped = make_request("cap", range(100, 117), max_tokens=10)  # 17 + 3 = max_model_len
    scheduler.add_request(stopped)
    scheduler.add_request(capped)
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        sampled = {
            i.request_id: [2000 + i.request.num_output_tokens]
            for i in output.scheduled
            if i.is_prefill_chunk_complete
        }
        if "stop" in sampled:
            sampled["stop"] = [1000 + stopped.num_output_tokens]
        scheduler.update_from_output(output, sampled)
    assert stopped.status == RequestStatus.FINISHED_STOPPED
    assert stopped.output_token_ids == [1000, 1001, 1002]
    assert capped.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert capped.num_tokens == 20


def test_multiple_sampled_tokens_are_cut_at_the_stop_token():
    config = SchedulerConfig(stop_token_ids=(7,))
    scheduler = Scheduler(make_manager(11), config)
    request = make_request("r", range(4), max_tokens=10)
    scheduler.add_request(request)
    output = scheduler.schedule()
    assert scheduler.update_from_output(output, {"r": [5, 6, 7, 8]}) == [request]
    assert request.output_token_ids == [5, 6, 7]


def test_bad_sampled_ids_are_rejected_and_change_nothing():
    scheduler = Scheduler(make_manager(11), SchedulerConfig(max_num_batched_tokens=8))
    scheduler.add_request(make_request("long", range(12), max_tokens=2))
    output = scheduler.schedule()
    with pytest.raises(InvalidArgumentError, match="mid-prefill"):
        scheduler.update_from_output(output, {"long": [1]})
    with pytest.raises(InvalidArgumentError, match="unscheduled"):
        scheduler.update_from_output(output, {"ghost": [1]})
    assert scheduler.requests["long"].num_computed_tokens == 0
    scheduler.update_from_output(output, {})
    output = scheduler.schedule()
    with pytest.raises(InvalidArgumentError, match="needs sampled token ids"):
        scheduler.update_from_output(output, {})
    with pytest.raises(RequestStateError, match="before update_from_output"):
        scheduler.schedule()
    assert scheduler.requests["long"].num_computed_tokens == 8
    scheduler.update_from_output(output, {"long": [3]})
    assert scheduler.requests["long"].output_token_ids == [3]


def test_add_request_validation():
    scheduler = Scheduler(make_manager(11))
    scheduler.add_request(make_request("a", range(4), max_tokens=1))
    with pytest.raises(RequestStateError, match="already scheduled"):
        scheduler.add_request(make_request("a", range(4), max_tokens=1))
    with pytest.raises(InvalidArgumentError, match="max_model_len 24"):
        scheduler.add_request(make_request("big", range(24), max_tokens=1))
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        scheduler.add_request(make_request("zero", range(4), max_tokens=0))
    with pytest.raises(RequestStateError, match="block hasher"):
        scheduler.add_request(Request("nohash", [1, 2, 3], max_tokens=1))
    assert list(scheduler.requests) == ["a"]


def test_config_errors_at_construction():
    with pytest.raises(ConfigError, match="cannot hold one request"):
        Scheduler(make_manager(5, max_model_len=24))
    with pytest.raises(ConfigError, match="without chunked prefill"):
        Scheduler(
            make_manager(11),
            SchedulerConfig(max_num_batched_tokens=8, enable_chunked_prefill=False),
        )
    with pytest.raises(ConfigError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_decode_equals_one_call_per_request(seed):
    # A small pool, shared prefixes and several running requests: decodes run out of blocks
    # mid-batch, so preemptions land before, inside and after the batched run.
    rng = random.Random(seed)
    prefixes = [[1] * 8, [2] * 6, []]
    requests = [
        (
            rng.choice(prefixes) + [rng.randrange(50, 90) for _ in range(rng.randrange(1, 9))],
            rng.randrange(4, 14),
        )
        for _ in range(14)
    ]
    outputs = []
    for batched in (True, False):
        scheduler = Scheduler(
            make_manager(12, max_model_len=40),
            SchedulerConfig(max_num_batched_tokens=12, max_num_seqs=5),
            batched_decode=batched,
        )
        for index, (prompt, max_tokens) in enumerate(requests):
            scheduler.add_request(make_request(f"r{index}", prompt, max_tokens=max_tokens))
        steps = []
        while scheduler.has_unfinished_requests():
            output, finished = step(scheduler)
            steps.append(
                (
                    batch(output),
                    [item.new_block_ids for item in output.scheduled],
                    output.preempted_request_ids,
                    [request.request_id for request in finished],
                )
            )
        outputs.append(steps)
    assert outputs[0] == outputs[1]
    assert any(preempted for _, _, preempted, _ in outputs[0])


def test_block_copies_of_sub_block_hits_reach_the_output_and_are_released():
    # Full attention at 2 tokens a block and Mamba "align" at 4 (sub-block hits on): a 6-token
    # chunk ends inside a Mamba block, whose state the next step would overwrite, so that step
    # copies it into a block the cache keeps (the scenario of tests/hybrid/test_partial_hits.py).
    manager = KVCacheManager(hybrid_config(24, full(2), mamba(4)), 24, hash_block_size=2)
    scheduler = Scheduler(manager, SchedulerConfig(max_num_batched_tokens=6))
    scheduler.add_request(hybrid_request("p", [0, 0, 1, 1, 2, 2, 3], 2))
    first, _ = step(scheduler)
    assert first.kv_cache_block_copies == []
    output = scheduler.schedule()
    assert output.kv_cache_block_copies == [(4, 6)]  # block 5 went to full attention
    # Until the step ran, both ends stay held outside any table (the check counts them).
    assert [manager.block_pool.blocks[i].ref_cnt for i in (4, 6)] == [2, 1]
    scheduler.check_invariants()
    scheduler.update_from_output(output, sampled_for(output))
    assert [manager.block_pool.blocks[i].ref_cnt for i in (4, 6)] == [1, 0]
    assert manager.block_pool.blocks[6].block_hash_num_tokens == 6  # the cache's copy
    scheduler.check_invariants()
