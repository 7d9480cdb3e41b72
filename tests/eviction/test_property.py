"""The stateful property test of tests/core/test_property.py, once per eviction policy, plus two
variants: retention hints with a moving clock, and a host-memory tier. Every step checks every
invariant (the pool's, the policy's own structure, the retention levels', the host tier's)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule, run_state_machine_as_test

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, RequestStatus
from pagedkv.eviction import EvictionConfig
from pagedkv.retention import RetentionConfig, TokenRangeRetention
from tests.core.test_property import BLOCK_SIZE, MAX_MODEL_LEN, PREFIXES, STEPS_RUN, KVCacheMachine
from tests.support.builders import make_request
from tests.support.eviction import ALL_POLICIES, HashOrderOracle

SETTINGS = settings(
    max_examples=20,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def machine_for(config: EvictionConfig) -> type[KVCacheMachine]:
    return type(f"Machine_{config.policy}", (KVCacheMachine,), {"EVICTION": config})


def policy_config(policy: str, **kwargs) -> EvictionConfig:
    if policy == "belady":
        kwargs["oracle"] = HashOrderOracle()
    return EvictionConfig(policy=policy, **kwargs)


def run_machine(
    machine: type[KVCacheMachine], min_steps: int = 500, max_examples: int = 20
) -> None:
    STEPS_RUN[0] = 0
    run_state_machine_as_test(machine, settings=settings(SETTINGS, max_examples=max_examples))
    assert STEPS_RUN[0] >= min_steps, STEPS_RUN[0]


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_random_interleavings_keep_invariants_per_policy(policy):
    run_machine(machine_for(policy_config(policy)))


CLOCK = FakeClock()


class RetentionMachine(KVCacheMachine):
    """Requests carry retention hints; time moves, so durations lapse while blocks are free."""

    @precondition(lambda self: len(self.waiting) < 6)
    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 5), min_size=1, max_size=20),
        priority=st.sampled_from([0, 10, 35, 60, 100]),
        end=st.sampled_from([4, 8, None]),
        duration_s=st.sampled_from([None, 1.0, 5.0]),
        decode_priority=st.sampled_from([5, 35, 90]),
    )
    def add_retained_request(self, prefix, suffix, priority, end, duration_s, decode_priority):
        tokens = (prefix + suffix)[: MAX_MODEL_LEN - 4]
        hints = RetentionConfig(
            (TokenRangeRetention(0, end, priority, duration_s),), decode_priority=decode_priority
        )
        req = make_request(f"r{next(self.ids)}", tokens, BLOCK_SIZE, max_tokens=8, retention=hints)
        self.waiting.append(req)

    @rule(seconds=st.sampled_from([0.5, 2.0, 10.0]))
    def tick(self, seconds):
        CLOCK.now_s += seconds


@pytest.mark.parametrize("policy", ALL_POLICIES)
def test_retention_hints_keep_invariants_per_policy(policy):
    CLOCK.now_s = 0.0
    config = policy_config(policy, retention=True, max_retained_fraction=0.4, clock=CLOCK)
    machine = type(f"RetentionMachine_{policy}", (RetentionMachine,), {"EVICTION": config})
    run_machine(machine, min_steps=250, max_examples=10)


class HostTierMachine(KVCacheMachine):
    """Admissions also take the blocks the host tier holds, as external (loaded) tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.host_view: set[bytes] = set()  # the host tier as its events describe it

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit_with_host_hits(self, data):
        req = data.draw(st.sampled_from(self.waiting))
        manager = self.manager
        hits, num_hit_tokens, _ = manager.get_computed_blocks(req)
        num_host = manager.get_num_host_hit_tokens(req, num_hit_tokens)
        host = manager.block_pool.host_tier
        assert num_host % BLOCK_SIZE == 0 and num_hit_tokens + num_host <= req.num_tokens - 1
        first = num_hit_tokens // BLOCK_SIZE
        assert all(h in host for h in req.block_hashes[first : first + num_host // BLOCK_SIZE])
        num_new = req.num_tokens - num_hit_tokens - num_host
        new_blocks = manager.allocate_slots(
            req,
            num_new,
            num_hit_tokens,
            hits,
            num_external_computed_tokens=num_host,
            has_scheduled_reqs=bool(self.running),
        )
        if new_blocks is None:
            return
        manager.load_from_host(req, num_hit_tokens, num_host)
        req.num_computed_tokens = req.num_tokens
        req.status = RequestStatus.RUNNING
        self.waiting.remove(req)
        self.running.append(req)
        self.check_table(req, 0)

    @precondition(lambda self: self.manager.block_pool.kv_event_queue)
    @rule()
    def take_events(self):
        """Device events as in the base machine; host events mirror the host tier exactly."""
        for event in self.manager.take_events():
            if type(event) is BlockStored and event.medium == "CPU":
                assert event.token_ids == [] and event.block_size == 0
                self.host_view.add(event.block_hashes[0])
            elif type(event) is BlockRemoved and event.medium == "CPU":
                self.host_view.remove(event.block_hashes[0])
            elif type(event) is AllBlocksCleared:
                self.host_view.clear()
            elif type(event) is BlockStored:
                assert len(event.token_ids) == len(event.block_hashes) * BLOCK_SIZE
        assert self.host_view == set(self.manager.block_pool.host_tier.cached_hashes())


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "cost"])
def test_host_tier_keeps_invariants(policy):
    config = policy_config(policy, host_num_blocks=8)
    machine = type(f"HostTierMachine_{policy}", (HostTierMachine,), {"EVICTION": config})
    run_machine(machine, min_steps=250, max_examples=10)


class LookaheadMachine(RetentionMachine):
    """Waiting requests are registered with the look-ahead (and dropped) at random points."""

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def register_waiting(self, data):
        self.manager.add_waiting(data.draw(st.sampled_from(self.waiting)))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def unregister_waiting(self, data):
        self.manager.remove_waiting(data.draw(st.sampled_from(self.waiting)))


@pytest.mark.parametrize("policy", ["lru", "s3fifo", "continuation", "hazard"])
@pytest.mark.parametrize("retention", [False, True])
def test_the_lookahead_keeps_invariants(policy, retention):
    CLOCK.now_s = 0.0
    config = policy_config(policy, lookahead=True, retention=retention, clock=CLOCK)
    machine = type(f"LookaheadMachine_{policy}", (LookaheadMachine,), {"EVICTION": config})
    run_machine(machine, min_steps=250, max_examples=10)
