"""Routing: policies on a synthetic workload, outage fallback and recovery, and an index fed
only by events over ZeroMQ that equals every instance's real cache after 10,000 operations."""

from __future__ import annotations

import logging
import random
import time

import pytest

from pagedkv import (
    BlockStored,
    InvalidArgumentError,
    Request,
    make_request_block_hasher,
)
from pagedkv.router import (
    IndexUnavailableError,
    InMemoryPrefixIndex,
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    Router,
    make_policy,
    request_block_hashes,
)
from tests.support.kv_workload import RandomDriver, make_manager, pool_contents

IDS = ["i0", "i1", "i2"]


def test_round_robin_cycles_and_least_loaded_picks_minimum():
    policy = RoundRobinPolicy()
    assert [policy.choose(IDS, {}, None) for _ in range(5)] == ["i0", "i1", "i2", "i0", "i1"]
    least = LeastLoadedPolicy()
    assert least.choose(IDS, {"i0": 3, "i1": 1, "i2": 1}, None) == "i1"
    assert least.choose(IDS, {}, None) == "i0"


def test_prefix_aware_prefers_longest_match_then_load():
    policy = PrefixAwarePolicy()
    loads = {"i0": 5, "i1": 2, "i2": 0}
    assert policy.choose(IDS, loads, {"i0": 4, "i1": 4, "i2": 1}) == "i1"
    assert policy.choose(IDS, loads, {"i0": 0, "i1": 0, "i2": 0}) == "i2"
    assert policy.choose(IDS, loads, None) == "i2"
    guarded = PrefixAwarePolicy(max_load_gap=2)  # candidates: load <= 0 + 2
    assert guarded.choose(IDS, loads, {"i0": 9, "i1": 3, "i2": 1}) == "i1"
    assert guarded.choose(IDS, {"i0": 2}, {"i0": 9, "i1": 0, "i2": 0}) == "i0"
    with pytest.raises(InvalidArgumentError, match="max_load_gap"):
        PrefixAwarePolicy(max_load_gap=-1)
    with pytest.raises(InvalidArgumentError, match="unknown routing policy"):
        make_policy("random")


def synthetic_trace(seed: int, num_requests: int) -> list[Request]:
    """Requests from 4 long shared prefixes (system prompts) plus short unique suffixes."""
    rng = random.Random(seed)
    hasher = make_request_block_hasher(4)
    prefixes = [[rng.randrange(1000) for _ in range(40)] for _ in range(4)]
    return [
        Request(
            f"r{n}",
            prefixes[rng.randrange(4)] + [rng.randrange(1000) for _ in range(6)],
            block_hasher=hasher,
        )
        for n in range(num_requests)
    ]


def run_cluster(policy: str, trace: list[Request]) -> tuple[float, dict[str, int]]:
    """Admit each request on the routed instance; the router learns from events only.
    Returns the token hit rate and requests per instance."""
    managers = {i: make_manager(num_blocks=64) for i in IDS}
    router = Router(IDS, policy)
    hits = queries = 0
    placed = dict.fromkeys(IDS, 0)
    running: dict[str, list[Request]] = {i: [] for i in IDS}
    for request in trace:
        loads = {i: len(running[i]) for i in IDS}
        decision = router.route(request_block_hashes(request), loads)
        manager = managers[decision.instance_id]
        hit = manager.get_computed_blocks(request)
        if decision.policy == "prefix-aware":
            assert decision.matched_blocks * 4 >= hit.num_computed_tokens
        todo = request.num_tokens - hit.num_computed_tokens
        assert manager.allocate_slots(request, todo, hit.num_computed_tokens, hit.blocks)
        hits += hit.num_computed_tokens
        queries += request.num_tokens
        placed[decision.instance_id] += 1
        running[decision.instance_id].append(request)
        if len(running[decision.instance_id]) > 3:  # finish the oldest
            manager.free(running[decision.instance_id].pop(0))
        for instance_id, each in managers.items():
            router.apply_events(instance_id, each.take_events())
    return hits / queries, placed


def test_policies_on_a_small_synthetic_workload():
    trace = synthetic_trace(seed=5, num_requests=60)
    rr_rate, rr_placed = run_cluster("round-robin", trace)
    trace = synthetic_trace(seed=5, num_requests=60)
    ll_rate, ll_placed = run_cluster("least-loaded", trace)
    trace = synthetic_trace(seed=5, num_requests=60)
    pa_rate, pa_placed = run_cluster("prefix-aware", trace)
    assert rr_placed == {"i0": 20, "i1": 20, "i2": 20}
    assert sum(ll_placed.values()) == 60
    # Prefix-aware keeps each system prompt on one instance: only the first request of each
    # prompt misses, so it beats both load-only policies.
    assert pa_rate > rr_rate and pa_rate > ll_rate
    assert pa_rate > 0.75


class FlakyIndex(InMemoryPrefixIndex):
    """An in-memory index that can be switched off, like a Redis outage."""

    def __init__(self) -> None:
        super().__init__()
        self.up = True

    def _check(self) -> None:
        if not self.up:
            raise IndexUnavailableError("backend down")

    def apply_events(self, instance_id, events):
        self._check()
        super().apply_events(instance_id, events)

    def match_lengths(self, block_hashes, instance_ids, media=None):
        self._check()
        return super().match_lengths(block_hashes, instance_ids, media)

    def ping(self):
        self._check()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_outage_falls_back_with_one_warning_and_recovers_from_snapshots(caplog):
    index = FlakyIndex()
    clock = FakeClock()
    truth = {"i0": [BlockStored([1, 2], None, [], 4, None, "GPU", group_idx=0)], "i1": []}
    router = Router(
        ["i0", "i1"],
        "prefix-aware",
        index=index,
        snapshot_source=lambda i: truth[i],
        retry_interval_s=5.0,
        clock=clock,
    )
    loads = {"i0": 3, "i1": 0}
    assert router.apply_events("i0", truth["i0"])
    assert router.route([1, 2], loads).instance_id == "i0"
    index.up = False
    with caplog.at_level(logging.WARNING, logger="pagedkv.router.router"):
        first = router.route([1, 2], loads)
        assert not router.apply_events("i1", [BlockStored([1], None, [], 4, None, "GPU")])
        second = router.route([1, 2], loads)
    assert (first.instance_id, first.policy, first.fallback) == ("i1", "least-loaded", True)
    assert second.fallback and router.degraded
    assert [r.message for r in caplog.records].count(
        "prefix index unavailable (backend down): routing falls back to least-loaded until it "
        "recovers"
    ) == 1
    index.up = True
    clock.now += 1.0  # before the retry interval: still degraded
    assert router.route([1, 2], loads).fallback
    clock.now += 5.0
    # Meanwhile i1 cached the prefix (the dropped event); the snapshot brings it back.
    truth["i1"] = [BlockStored([1, 2], None, [], 4, None, "GPU", group_idx=0)]
    recovered = router.route([1, 2], loads)
    assert not router.degraded and router.num_recoveries == 1
    assert (recovered.instance_id, recovered.matched_blocks) == ("i1", 2)
    assert router.num_fallback_decisions == 3 and router.num_dropped_event_batches == 1


def test_router_rejects_bad_configuration():
    with pytest.raises(InvalidArgumentError, match="unique"):
        Router(["a", "a"])
    with pytest.raises(InvalidArgumentError, match="fallback"):
        Router(["a"], fallback=PrefixAwarePolicy())
    with pytest.raises(InvalidArgumentError, match="unknown instance"):
        Router(["a"]).apply_events("b", [])


def test_index_fed_over_zmq_equals_every_pool_after_10000_operations():
    zmq_events = pytest.importorskip("pagedkv.wire.transport")
    rng = random.Random(2024)
    managers = {i: make_manager(num_blocks=40) for i in IDS}
    drivers = {i: RandomDriver(managers[i], seed=n) for n, i in enumerate(IDS)}
    publishers = {
        i: zmq_events.ZmqEventPublisher(f"inproc://kv-{i}", f"inproc://kv-{i}-replay") for i in IDS
    }
    subscribers = {
        i: zmq_events.ZmqEventSubscriber(
            f"inproc://kv-{i}", f"inproc://kv-{i}-replay", replay_timeout_s=2.0
        )
        for i in IDS
    }
    router = Router(IDS, "prefix-aware")
    seen: dict[str, int] = {}
    try:
        time.sleep(0.05)

        def drain(expected: dict[str, int]) -> None:
            deadline = time.monotonic() + 10
            for i in IDS:
                while subscribers[i].last_seq != expected[i] - 1:
                    assert time.monotonic() < deadline, f"{i}: stuck at {subscribers[i].last_seq}"
                    for item in subscribers[i].poll(0.01):
                        router.apply_events(i, item.batch.events)
                        for event in item.batch.events:
                            name = type(event).__name__
                            seen[name] = seen.get(name, 0) + 1

        for op in range(1, 10_001):
            instance_id = rng.choice(IDS)
            drivers[instance_id].step()
            if op % 7 == 0:
                publishers[instance_id].publish(managers[instance_id].take_events())
            if op % 2500 == 0:
                for i in IDS:
                    publishers[i].publish(managers[i].take_events())
                drain({i: publishers[i].next_seq for i in IDS})
                for i in IDS:
                    managers[i].check_invariants()
                    assert router.index.instance_contents(i) == pool_contents(managers[i])
        assert sum(d.num_ops for d in drivers.values()) == 10_000
        assert all(pool_contents(m) for m in managers.values())  # non-trivial end state
        assert min(seen.values()) >= 10 and len(seen) == 3, seen  # stores, removals, resets
        assert router.index.num_unknown_removals == 0
        assert all(s.num_missed == 0 and s.num_malformed == 0 for s in subscribers.values())
    finally:
        for i in IDS:
            subscribers[i].close()
            publishers[i].shutdown()
