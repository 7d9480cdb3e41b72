"""The Redis index against a real redis-server: contents equal to real pools after random
operations, and an outage (the server stopped) -> fallback with a warning -> recovery."""

from __future__ import annotations

import logging
import random

import pytest

from pagedkv import BlockRemoved, BlockStored, Request, make_request_block_hasher
from pagedkv.router import IndexLostError, Router, request_block_hashes
from pagedkv.wire.snapshot import CacheMirror
from tests.support.kv_workload import RandomDriver, make_manager, pool_contents
from tests.support.redis_server import RedisServer, import_redis, redis_server  # noqa: F401 - fixture

redis = import_redis()  # skips, or fails under PAGEDKV_REQUIRE_REDIS=1

from pagedkv.router.redis_index import RedisPrefixIndex  # noqa: E402

pytestmark = pytest.mark.redis

IDS = ["i0", "i1"]


def test_redis_index_equals_pools_after_random_operations(redis_server):  # noqa: F811
    index = RedisPrefixIndex(redis_server.url, namespace="pools")
    router = Router(IDS, "prefix-aware", index=index)
    managers = {i: make_manager(num_blocks=40) for i in IDS}
    drivers = {i: RandomDriver(managers[i], seed=n + 40) for n, i in enumerate(IDS)}
    rng = random.Random(9)
    try:
        for op in range(1, 3001):
            instance_id = rng.choice(IDS)
            drivers[instance_id].step()
            if op % 5 == 0:
                for i in IDS:
                    assert router.apply_events(i, managers[i].take_events())
        for i in IDS:
            assert router.apply_events(i, managers[i].take_events())
            assert index.instance_contents(i) == pool_contents(managers[i])
        assert index.num_unknown_removals == 0
    finally:
        index.drop_namespace()


def test_outage_falls_back_with_a_warning_and_recovers(tmp_path, caplog):
    server = RedisServer(tmp_path)
    server.start()
    try:
        index = RedisPrefixIndex(server.url, namespace="outage", socket_timeout_s=0.2)
        managers = {i: make_manager(num_blocks=32) for i in IDS}
        # The router side mirrors each instance from the same events; after an outage it
        # resynchronises Redis from these snapshots (over ZeroMQ: a snapshot request).
        mirrors = {i: CacheMirror() for i in IDS}
        router = Router(
            IDS,
            "prefix-aware",
            index=index,
            snapshot_source=lambda i: mirrors[i].snapshot_events(),
            retry_interval_s=0.0,
        )
        hasher = make_request_block_hasher(4)

        def admit(instance_id: str, request: Request) -> None:
            assert managers[instance_id].allocate_slots(request, request.num_tokens)
            events = managers[instance_id].take_events()
            mirrors[instance_id].apply(events)
            router.apply_events(instance_id, events)

        prompt = list(range(100, 132))
        admit("i1", Request("a", prompt + [1], block_hasher=hasher))
        probe = Request("probe", prompt + [2], block_hasher=hasher)
        loads = {"i0": 0, "i1": 5}
        decision = router.route(request_block_hashes(probe), loads)
        assert (decision.instance_id, decision.matched_blocks, decision.fallback) == (
            "i1",
            8,
            False,
        )

        server.stop()
        with caplog.at_level(logging.WARNING, logger="pagedkv.router.router"):
            degraded = router.route(request_block_hashes(probe), loads)
        assert (degraded.instance_id, degraded.policy, degraded.fallback) == (
            "i0",
            "least-loaded",
            True,
        )
        assert any("falls back to least-loaded" in r.message for r in caplog.records)
        # Events during the outage are dropped by the router (the mirror still sees them).
        other = list(range(500, 532))
        managers["i0"].allocate_slots(Request("b", other + [3], block_hasher=hasher), 33)
        events = managers["i0"].take_events()
        mirrors["i0"].apply(events)
        assert not router.apply_events("i0", events)

        server.start()  # same port, empty (no persistence): recovery must resynchronise
        recovered = router.route(
            request_block_hashes(Request("p2", other + [4], block_hasher=hasher)), loads
        )
        assert not router.degraded and router.num_recoveries == 1
        assert (recovered.instance_id, recovered.matched_blocks) == ("i0", 8)
        for i in IDS:
            assert index.instance_contents(i) == pool_contents(managers[i])
        assert router.route(request_block_hashes(probe), loads).instance_id == "i1"
    finally:
        server.stop()


def test_a_claim_fences_earlier_writers_and_a_flush_is_noticed(redis_server):  # noqa: F811
    first = RedisPrefixIndex(redis_server.url, namespace="fence")
    second = RedisPrefixIndex(redis_server.url, namespace="fence")
    try:
        first.claim()
        first.apply_events("a", [BlockStored([1, 2], None, [], 4, None, "GPU", group_idx=0)])
        second.claim()  # a new writer (or this router after an outage) takes over
        with pytest.raises(IndexLostError, match="epoch is no longer"):
            first.apply_events("a", [BlockStored([3], None, [], 4, None, "GPU", group_idx=0)])
        with pytest.raises(IndexLostError):
            first.match_lengths([1, 2], ["a"])
        assert second.match_lengths([1, 2, 3], ["a"]) == {"a": 2}  # the late write never landed
        second.client.flushdb()
        with pytest.raises(IndexLostError):
            second.match_lengths([1, 2], ["a"])  # never an answer from an emptied index
    finally:
        second.drop_namespace()


def test_idempotent_stores_ignore_resent_blocks(redis_server):  # noqa: F811
    index = RedisPrefixIndex(redis_server.url, namespace="idem", idempotent_stores={"v"})
    try:
        stored = BlockStored([5, 6], None, [], 4, None, "GPU", group_idx=0)
        index.apply_events("v", [stored, stored])  # vLLM "full" mode re-sends a prefix hit
        index.apply_events("p", [stored, stored])  # pagedkv: a second copy
        index.apply_events("v", [BlockRemoved([5, 6], "GPU", 0)])
        index.apply_events("p", [BlockRemoved([5, 6], "GPU", 0)])
        assert index.instance_contents("v") == {}
        assert index.instance_contents("p") == {("GPU", 0, 5): 1, ("GPU", 0, 6): 1}
    finally:
        index.drop_namespace()
