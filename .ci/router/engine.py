"""One engine of the router's end-to-end test (.ci/router-e2e), run in vLLM 0.33's venv: vLLM's
own KVCacheManager caching prompts, vLLM's own ZmqEventPublisher built as vLLM's scheduler
builds it (EventPublisherFactory from a KVEventsConfig), publishing each step's events as the
scheduler does (one KVEventBatch of `take_events()` per step that has events).

    python engine.py PUB_PORT REPLAY_PORT NUM_BLOCKS BUFFER_STEPS

Driven by JSON lines on stdin, one answer line each on stdout:
  {"op": "step", "prompts": [[...], ...]}  cache each prompt (lookup, allocate, free: a
      prefill), publish the step's events; answers {"seq": last published seq or null}
  {"op": "probe", "prompts": [[...], ...]}  vLLM's own get_computed_blocks for each prompt,
      in blocks (nothing allocated); answers {"blocks": [...], "seq": ...}
  {"op": "flush"}  wait until the publisher thread sent everything queued
Block size 16, sha256_cbor; the root hash follows PYTHONHASHSEED as in vLLM.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from vllm.config.kv_events import KVEventsConfig
from vllm.distributed.kv_events import EventPublisherFactory, KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

BLOCK_SIZE = 16


def main() -> None:
    pub_port, replay_port, num_blocks, buffer_steps = (int(a) for a in sys.argv[1:5])
    init_none_hash(sha256_cbor)
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)],
    )
    manager = KVCacheManager(
        config,
        max_model_len=8192,
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
        enable_kv_cache_events=True,
    )
    events_config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        buffer_steps=buffer_steps,
        hwm=32,
    )
    publisher = EventPublisherFactory.create(events_config, 0)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256_cbor)
    num_published = 0
    count = 0
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "step":
            for tokens in command["prompts"]:
                count += 1
                request = Request(
                    f"r{count}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher
                )
                blocks, num_computed, _ = manager.get_computed_blocks(request)
                allocated = manager.allocate_slots(
                    request, request.num_tokens - num_computed, num_computed, blocks
                )
                if allocated is not None:
                    manager.free(request)
            events = manager.take_events()
            if events:
                publisher.publish(KVEventBatch(ts=time.time(), events=events))
                num_published += 1
            answer: dict = {"seq": num_published - 1 if num_published else None}
        elif op == "probe":
            found = []
            for tokens in command["prompts"]:
                count += 1
                request = Request(
                    f"p{count}", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher
                )
                _, num_computed, _ = manager.get_computed_blocks(request)
                found.append(num_computed // BLOCK_SIZE)
            answer = {"blocks": found, "seq": num_published - 1 if num_published else None}
        elif op == "flush":
            deadline = time.monotonic() + 10
            while publisher._event_queue.qsize() and time.monotonic() < deadline:  # noqa: SLF001
                time.sleep(0.002)
            answer = {"seq": num_published - 1 if num_published else None}
        else:
            answer = {"error": f"unknown op {op!r}"}
        print(json.dumps(answer), flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main()
