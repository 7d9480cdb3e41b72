"""Two engines publish their KV events over ZeroMQ; a router subscribes to both, keeps a prefix
index fed only by those events, and sends a request to the engine that caches its prefix
(docs/events.md). Everything runs in this process, on free loopback ports.

    python examples/router_publisher.py

Needs the [events] extra (pyzmq, msgspec): pip install -e '.[events]'.
"""

from __future__ import annotations

from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)
from pagedkv.router import Router
from pagedkv.wire.subscriber import ZmqEventSubscriber
from pagedkv.wire.transport import ZmqEventPublisher

BLOCK_SIZE = 16
ENGINES = ("engine-0", "engine-1")


def make_manager() -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype_bytes=2)
    config = KVCacheConfig(num_blocks=64, kv_cache_groups=[KVCacheGroupSpec(["layers"], spec)])
    return KVCacheManager(config, max_model_len=4096, enable_kv_cache_events=True)


def main() -> None:
    hasher = make_request_block_hasher(hash_block_size=BLOCK_SIZE)
    managers = {engine_id: make_manager() for engine_id in ENGINES}
    # Each engine binds a PUB and a replay socket (free loopback ports here: `*`); the router
    # connects to the addresses they got.
    publishers = {
        engine_id: ZmqEventPublisher(
            "tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv", bind=True
        )
        for engine_id in ENGINES
    }
    subscribers = {
        engine_id: ZmqEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="kv")
        for engine_id, pub in publishers.items()
    }
    router = Router(list(ENGINES))
    try:
        # Each engine serves one conversation: its prompt's full blocks are cached there.
        prompts = {"engine-0": list(range(64)), "engine-1": list(range(1000, 1048))}
        for engine_id, prompt in prompts.items():
            manager = managers[engine_id]
            request = Request(f"{engine_id}-r0", prompt, block_hasher=hasher)
            manager.allocate_slots(request, request.num_tokens)  # the engine's step
            manager.free(request)  # finished; its blocks stay cached
            publishers[engine_id].publish(manager.take_events())  # once a step
        # The router's side: apply every batch (a PUB socket drops what it sends before the
        # subscriber connects; `fill_to` fetches those by replay).
        for engine_id, sub in subscribers.items():
            lost = sub.num_lost
            received = sub.poll(timeout_s=0.1) + sub.fill_to(publishers[engine_id].next_seq)
            for item in received:
                router.apply_batch(engine_id, item.seq, item.batch)
            if sub.num_lost != lost:
                router.mark_lost(engine_id)  # cleared until a snapshot restores it
        # A follow-up turn of engine-1's conversation: its 48 cached tokens plus 20 new ones.
        prompt = prompts["engine-1"] + list(range(2000, 2020))
        follow_up = Request("turn-2", prompt, block_hasher=hasher)
        print("cached prefix per engine (blocks):", router.score(follow_up.block_hashes))
        decision = router.route(follow_up.block_hashes, loads={"engine-0": 0, "engine-1": 2})
        print(
            f"route to {decision.instance_id}: {decision.policy}, {decision.matched_blocks} blocks"
        )
    finally:
        for sub in subscribers.values():
            sub.close()
        for publisher in publishers.values():
            publisher.shutdown()


if __name__ == "__main__":
    main()
