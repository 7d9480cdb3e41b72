"""Liveness is part of the index: a down instance scores 0 and is not routed to at once, its
entries wait a grace period, a restart clears them first; after a loss the instance is safe
("exact from now") with a coverage estimate; a misconfigured instance is caught from its own
stream; ties are broken by load, then at random with a seed."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from pagedkv import AllBlocksCleared, BlockRemoved, BlockStored, Request, make_request_block_hasher
from pagedkv.block import to_external_hash
from pagedkv.router import PrefixAwarePolicy, Router
from pagedkv.router.hash_check import BlockHashCheck
from pagedkv.router.router import NEVER_CONNECTED, NOT_CONNECTED_YET, NoInstanceAvailableError
from pagedkv.wire.codec import EventBatch

BLOCK_SIZE = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stored(hashes: list[int], tokens: list[int] | None = None, parent: int | None = None):
    return BlockStored(hashes, parent, tokens or [], BLOCK_SIZE, None, "GPU", group_idx=0)


def removed(hashes: list[int]):
    return BlockRemoved(hashes, "GPU", group_idx=0)


def make_router(**kwargs) -> tuple[Router, Clock]:
    clock = Clock()
    router = Router(["a", "b"], clock=clock, **kwargs)
    return router, clock


def test_a_down_instance_scores_zero_and_gets_no_route_at_once():
    router, clock = make_router(grace_s=10)
    router.apply_events("a", [stored([1, 2, 3])])
    router.apply_events("b", [stored([1])])
    assert router.score([1, 2, 3]) == {"a": 3, "b": 1}
    assert router.route([1, 2, 3], {}).instance_id == "a"

    router.set_down("a", "disconnected")
    assert router.score([1, 2, 3]) == {"a": 0, "b": 1}
    assert {router.route([1, 2, 3], {}).instance_id for _ in range(20)} == {"b"}
    assert router.states["a"].safe is False and router.exact is False
    assert router.ready is True  # b serves; a is declared down

    # Resumes without a restart within the grace period: the entries count again.
    clock.now += 5
    router.expire_down()
    router.set_down("a", None)
    assert router.score([1, 2, 3]) == {"a": 3, "b": 1} and router.exact is True

    # Down past the grace period: the entries are dropped (safe, inexact, coverage 0).
    router.set_down("a", "disconnected")
    clock.now += 10
    router.expire_down()
    router.set_down("a", None)
    assert router.score([1, 2, 3]) == {"a": 0, "b": 1}
    assert router.states["a"].exact is False and router.states["a"].safe is True
    assert router.states["a"].coverage == 0.0

    router.set_down("a", "disconnected")
    router.set_down("b", "health check failed: HTTP 503")
    with pytest.raises(NoInstanceAvailableError, match="health check failed"):
        router.route([1], {})
    assert router.ready is False


def test_a_restart_clears_the_instance_before_its_new_stream_counts():
    router, _ = make_router()
    router.apply_batch("a", 0, EventBatch(1.0, [stored([1, 2])]))
    router.apply_batch("a", 1, EventBatch(2.0, [stored([3], parent=2)]))
    # The subscriber's restart: a synthetic snapshot (clear, stream from 0), then the new
    # publisher's batch 0, which stores only block 1.
    router.apply_batch("a", 0, EventBatch(3.0, [AllBlocksCleared()], snapshot_next_seq=0))
    router.apply_batch("a", 0, EventBatch(3.1, [stored([1])]))
    assert router.score([1, 2, 3]) == {"a": 1, "b": 0}
    assert router.states["a"].exact is True


def test_after_a_loss_the_instance_is_safe_with_a_coverage_estimate_then_exact_again():
    router, _ = make_router()
    router.apply_events("a", [stored([1, 2, 3, 4])])
    router.mark_lost("a")  # e.g. the replay buffer wrapped: entries cleared
    state = router.states["a"]
    assert (state.exact, state.safe, state.coverage) == (False, True, 0.0)
    assert router.score([1]) == {"a": 0, "b": 0}
    assert router.ready is True and router.exact is False
    router.apply_events("a", [stored([5, 6])])
    assert router.score([5, 6]) == {"a": 2, "b": 0}  # present entries are real
    # Four evictions: two of blocks the index holds (5, 6), two of blocks it lost (1, 2).
    router.apply_events("a", [removed([1, 5]), removed([2, 6])])
    assert state.coverage == 0.5 and state.exact is False
    router.apply_events("a", [AllBlocksCleared(), stored([7])])  # the engine emptied itself
    assert state.exact is True and state.coverage == 1.0 and router.exact is True
    assert router.score([7]) == {"a": 1, "b": 0}


def test_ready_waits_for_every_instance_to_connect_once_or_be_declared_down():
    router, _ = make_router()
    for instance_id in ("a", "b"):
        router.states[instance_id].ever_live = False
        router.set_down(instance_id, NOT_CONNECTED_YET)
    router.maybe_recover(force=True)
    assert router.ready is False
    router.set_down("a", None)
    assert router.ready is False  # b may still connect
    router.set_down("b", NEVER_CONNECTED)
    assert router.ready is True


def hashes_of(tokens: list[int], algorithm: str = "sha256_cbor", seed: str | None = None):
    hasher = make_request_block_hasher(BLOCK_SIZE, algorithm, seed)
    return [to_external_hash(h) for h in Request("r", tokens, block_hasher=hasher).block_hashes]


@pytest.mark.parametrize(
    ("engine", "cause"),
    [
        ({"seed": "4242"}, "PYTHONHASHSEED"),
        ({"algorithm": "sha256"}, "--prefix-caching-hash-algo"),
        ({"block_size": 8}, "--block-size 8"),
    ],
)
def test_a_misconfigured_instance_is_reported_never_scored(caplog, engine, cause):
    tokens = list(range(16))
    check = BlockHashCheck("sha256_cbor", BLOCK_SIZE)
    router, _ = make_router(hash_check=check)
    good = hashes_of(tokens)
    router.apply_batch("b", 0, EventBatch(1.0, [stored(good, tokens)]))
    size = engine.get("block_size", BLOCK_SIZE)
    theirs = hashes_of(tokens, engine.get("algorithm", "sha256_cbor"), engine.get("seed"))
    if size != BLOCK_SIZE:
        theirs = theirs[1::2]
    event = BlockStored(theirs, None, tokens, size, None, "GPU", group_idx=0)
    with caplog.at_level(logging.ERROR, logger="pagedkv.router.router"):
        router.apply_batch("a", 0, EventBatch(1.0, [event]))
        router.apply_batch("a", 1, EventBatch(2.0, [stored(theirs[:1], tokens[:4])]))
    problem = router.states["a"].misconfigured
    assert problem is not None and cause in problem
    assert [r.getMessage() for r in caplog.records] == [problem]  # one line
    assert router.score(good) == {"a": 0, "b": 4}
    assert router.score(theirs)["a"] == 0
    assert router.ready is False
    assert router.route(good, {}).instance_id == "b"
    # A restart (a new, fixed engine) checks again from scratch.
    router.apply_batch("a", 0, EventBatch(3.0, [AllBlocksCleared()], snapshot_next_seq=0))
    router.apply_batch("a", 0, EventBatch(3.1, [stored(good, tokens)]))
    assert router.states["a"].misconfigured is None and router.score(good)["a"] == 4


def test_a_matching_chain_passes_the_check_and_unverifiable_events_are_skipped():
    tokens = list(range(24))
    check = BlockHashCheck("sha256_cbor", BLOCK_SIZE, num_checks=2)
    good = hashes_of(tokens)
    events = [
        stored(good[:2], tokens[:8]),
        stored(good[2:], tokens[8:], parent=good[1]),  # chained from a block it hashed
        stored([12345], [], parent=None),  # a "full" report-mode re-send: no tokens
    ]
    assert check.check("a", events) is None and check.done("a")
    assert check.check("x", [stored([999], tokens[:4], parent=777)]) is None  # unknown parent


def test_prefix_aware_ties_go_least_loaded_then_seeded_random():
    ids = ["i0", "i1", "i2"]
    policy = PrefixAwarePolicy(seed=7)
    picks = Counter(policy.choose(ids, {}, {}) for _ in range(3000))
    assert set(picks) == set(ids) and min(picks.values()) > 900
    again = PrefixAwarePolicy(seed=7)
    first = PrefixAwarePolicy(seed=7)
    assert [again.choose(ids, {}, {}) for _ in range(50)] == [
        first.choose(ids, {}, {}) for _ in range(50)
    ]
    assert PrefixAwarePolicy().choose(ids, {"i0": 1, "i1": 0, "i2": 1}, {}) == "i1"
    assert PrefixAwarePolicy().choose(ids, {}, {"i2": 1}) == "i2"
