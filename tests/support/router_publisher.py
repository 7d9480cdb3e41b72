"""Test helper, run as a process: one engine instance (a real KVCacheManager) publishing its KV
events over ZeroMQ on fixed loopback ports, driven by JSON lines on stdin, answering on stdout.

    python tests/support/router_publisher.py PUB_PORT REPLAY_PORT FORMAT HASH_ALGORITHM [HOST]

FORMAT is pagedkv or vllm.

Commands: {"op": "admit", "tokens": [...]} caches a prompt (evicting what it must) and
publishes the step's events; {"op": "resend", "tokens": [...]} publishes BlockStored for the
prompt's cached prefix again (vLLM's kv_cache_report_mode="full" on a prefix hit);
{"op": "contents"} answers the pool's cached (group, int64 hash) -> copies and the next seq.
A vLLM-format instance publishes the same bytes but keeps no snapshot (as vLLM).
"""

from __future__ import annotations

import json
import sys

from pagedkv import (
    BlockStored,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)
from pagedkv.block import to_external_hash
from pagedkv.wire.transport import ZmqEventPublisher

BLOCK_SIZE = 4
NUM_BLOCKS = 24


def main() -> None:
    pub_port, replay_port, fmt, algorithm = sys.argv[1:5]
    host = sys.argv[5] if len(sys.argv) > 5 else "*"
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(NUM_BLOCKS, [KVCacheGroupSpec(["l0"], spec)])
    manager = KVCacheManager(config, max_model_len=256, enable_kv_cache_events=True)
    hasher = make_request_block_hasher(BLOCK_SIZE, algorithm)
    publisher = ZmqEventPublisher(
        f"tcp://{host}:{pub_port}",
        f"tcp://{host}:{replay_port}",
        track_state=fmt == "pagedkv",
        bind=True,
    )
    print(json.dumps({"ready": True}), flush=True)
    count = 0
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "admit":
            count += 1
            request = Request(f"r{count}", command["tokens"], block_hasher=hasher)
            hit = manager.get_computed_blocks(request)
            manager.allocate_slots(
                request, request.num_tokens - hit.num_computed_tokens, hit.num_computed_tokens,
                hit.blocks,
            )  # fmt: skip
            manager.free(request)
            publisher.publish(manager.take_events())
            answer: dict = {"seq": publisher.next_seq - 1}
        elif op == "resend":
            request = Request("resend", command["tokens"], block_hasher=hasher)
            hashes = [h for h in request.block_hashes if manager.block_pool.cached_hashes(0).get(h)]
            publisher.publish([BlockStored(hashes, None, [], BLOCK_SIZE, None, "GPU", group_idx=0)])
            answer = {"seq": publisher.next_seq - 1}
        elif op == "contents":
            pool = manager.block_pool
            answer = {
                "contents": [
                    [to_external_hash(h), len(ids)] for h, ids in pool.cached_hashes(0).items()
                ],
                "next_seq": publisher.next_seq,
            }
        else:
            answer = {"error": f"unknown op {op}"}
        print(json.dumps(answer), flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main()
