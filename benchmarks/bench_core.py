"""Core benchmarks (issue 2), run by hand; prints JSON.

(a) decode: 256 concurrent requests x 1,000-token prompts x 200 decode steps.
(b) shared prefix: a 4,000-token system prompt + unique suffixes, pool smaller than the
    working set, so eviction runs.
(c) hashing: ns per token for each algorithm at block sizes 16, 64 and 256.

    python benchmarks/bench_core.py [--only decode|shared|hashing] [--batched]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
from time import perf_counter

from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    make_request_block_hasher,
)
from pagedkv.hashing import BlockHasher


def make_manager(
    num_blocks: int, block_size: int, max_model_len: int, eviction: str | None = None
) -> KVCacheManager:
    spec = FullAttentionSpec(block_size, 8, 128, 2)
    config = KVCacheConfig(num_blocks, [KVCacheGroupSpec(["layer0"], spec)])
    if eviction is None:  # the default; also runs against trees without pagedkv.eviction
        return KVCacheManager(config, max_model_len=max_model_len)
    return KVCacheManager(config, max_model_len=max_model_len, eviction=eviction)


def run_serving(
    *,
    num_requests: int,
    batch: int,
    prompts: list[list[int]],
    decode_steps: int,
    num_blocks: int,
    block_size: int = 16,
    batched: bool = False,
    seed: int = 0,
    eviction: str | None = None,
) -> dict:
    """A minimal synchronous scheduler: decode every running request, then admit."""
    rng = random.Random(seed)
    # Slack: a preempted request re-admitted with its outputs samples one extra token.
    max_model_len = max(len(p) for p in prompts) + decode_steps + 64
    manager = make_manager(num_blocks, block_size, max_model_len, eviction)
    hasher = make_request_block_hasher(block_size)
    out_tokens = [rng.randrange(32000) for _ in range(4096)]
    timers = dict.fromkeys(("lookup", "prefill", "decode", "free", "hash"), 0.0)
    calls = dict.fromkeys(timers, 0)
    waiting = list(range(num_requests))[::-1]
    requests: dict[int, Request] = {}
    running: list[Request] = []
    decoded: dict[str, int] = {}
    preemptions = steps = hit_tokens = prompt_tokens = 0
    gc.collect()
    while waiting or running:
        steps += 1
        manager.new_step_starts()
        preempted = False
        t0 = perf_counter()
        if batched:
            index = 0
            calls["decode"] += len(running)
            while index < len(running):
                index += manager.allocate_decode_slots(running, index).num_allocated
                if index < len(running):
                    victim = running.pop()  # preempt the last admitted, then retry
                    manager.free(victim)
                    victim.status = RequestStatus.PREEMPTED
                    victim.num_computed_tokens = 0
                    victim.num_preemptions += 1
                    waiting.append(int(victim.request_id))
                    preemptions += 1
                    preempted = True
        else:
            index = 0
            while index < len(running):
                request = running[index]
                calls["decode"] += 1
                if manager.allocate_slots(request, 1) is not None:
                    index += 1
                    continue
                victim = running.pop()
                manager.free(victim)
                victim.status = RequestStatus.PREEMPTED
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                waiting.append(int(victim.request_id))
                preemptions += 1
                preempted = True
        timers["decode"] += perf_counter() - t0
        scheduled_decode = list(running)
        admitted = []
        if not preempted:
            while waiting and len(running) < batch:
                index = waiting[-1]
                request = requests.get(index)
                if request is None:
                    t0 = perf_counter()
                    request = Request(str(index), prompts[index], block_hasher=hasher)
                    timers["hash"] += perf_counter() - t0
                    requests[index] = request
                t0 = perf_counter()
                hit_blocks, num_hit, _ = manager.get_computed_blocks(request)
                timers["lookup"] += perf_counter() - t0
                calls["lookup"] += 1
                t0 = perf_counter()
                blocks = manager.allocate_slots(
                    request, request.num_tokens - num_hit, num_hit, hit_blocks
                )
                timers["prefill"] += perf_counter() - t0
                calls["prefill"] += 1
                if blocks is None:
                    break
                if request.num_preemptions == 0:
                    hit_tokens += num_hit
                    prompt_tokens += request.num_tokens
                waiting.pop()
                request.status = RequestStatus.RUNNING
                decoded.setdefault(request.request_id, 0)
                running.append(request)
                admitted.append(request)
        t0 = perf_counter()
        for request in admitted:
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(out_tokens[(steps + int(request.request_id)) & 4095])
        for request in scheduled_decode:
            request.num_computed_tokens += 1
            decoded[request.request_id] += 1
            request.append_output_token_ids(out_tokens[(steps + int(request.request_id)) & 4095])
        timers["hash"] += perf_counter() - t0
        keep = []
        for request in running:
            if decoded[request.request_id] >= decode_steps:
                t0 = perf_counter()
                manager.free(request)
                timers["free"] += perf_counter() - t0
                calls["free"] += 1
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            else:
                keep.append(request)
        running = keep
    manager.check_invariants()
    assert manager.block_pool.get_num_free_blocks() == num_blocks - 1
    return {
        "steps": steps,
        "preemptions": preemptions,
        "hit_rate": round(hit_tokens / prompt_tokens, 6) if prompt_tokens else 0.0,
        "manager_seconds": round(sum(v for k, v in timers.items() if k != "hash"), 6),
        "hash_seconds": round(timers["hash"], 6),
        "us_per_call": {
            k: round(1e6 * timers[k] / calls[k], 3) for k in timers if calls[k] and k != "hash"
        },
        "decode_us_per_step": round(1e6 * timers["decode"] / steps, 1),
    }


def bench_decode(batched: bool) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(1000)] for _ in range(1024)]
    return run_serving(
        num_requests=1024,
        batch=256,
        prompts=prompts,
        decode_steps=200,
        num_blocks=20000,
        batched=batched,
    )


def bench_shared(batched: bool) -> dict:
    rng = random.Random(1)
    system = [rng.randrange(32000) for _ in range(4000)]
    prompts = [system + [rng.randrange(32000) for _ in range(1000)] for _ in range(1024)]
    # Working set: 1 prefix (250 blocks) + 256 x (63 + 13) blocks ~ 19.7k; pool of 12k blocks.
    return run_serving(
        num_requests=1024,
        batch=256,
        prompts=prompts,
        decode_steps=200,
        num_blocks=12000,
        batched=batched,
    )


def bench_hashing() -> dict:
    rng = random.Random(2)
    tokens = [rng.randrange(32000) for _ in range(160_000)]
    out: dict[str, dict[str, float]] = {}
    for algorithm in ("sha256", "sha256_cbor", "xxh3_128"):
        out[algorithm] = {}
        for block_size in (16, 64, 256):
            hasher = make_request_block_hasher(block_size, algorithm)
            best = float("inf")
            for _ in range(3):
                t0 = perf_counter()
                Request("h", tokens, block_hasher=hasher)
                best = min(best, perf_counter() - t0)
            out[algorithm][f"bs{block_size}_ns_per_token"] = round(1e9 * best / len(tokens), 2)
    # Reference point: the same blocks through BlockHasher.hash_block_tokens one at a time.
    single = BlockHasher("sha256", 16)
    t0 = perf_counter()
    parent = None
    for start in range(0, len(tokens), 16):
        parent = single.hash_block_tokens(parent, tokens[start : start + 16])
    out["sha256_per_block_api_bs16_ns_per_token"] = round(
        1e9 * (perf_counter() - t0) / len(tokens), 2
    )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["decode", "shared", "hashing"])
    parser.add_argument("--batched", action="store_true", help="use allocate_decode_slots")
    args = parser.parse_args()
    result: dict = {"python": sys.version.split()[0], "machine": platform.machine()}
    if args.only in (None, "decode"):
        result["decode"] = bench_decode(args.batched)
    if args.only in (None, "shared"):
        result["shared_prefix"] = bench_shared(args.batched)
    if args.only in (None, "hashing"):
        result["hashing"] = bench_hashing()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
