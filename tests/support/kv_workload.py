"""Test helper: a real KVCacheManager driven by random operations (requests sharing prefixes,
prefill in chunks, decode, preemption, finish, evict_blocks, reset) with events on."""

from __future__ import annotations

import random

from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    make_request_block_hasher,
)
from pagedkv.block import to_external_hash
from pagedkv.request import RequestStatus

BLOCK_SIZE = 4


def make_manager(num_blocks: int = 48, events: bool = True, **kwargs) -> KVCacheManager:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return KVCacheManager(config, max_model_len=256, enable_kv_cache_events=events, **kwargs)


def pool_contents(manager: KVCacheManager, use_int: bool = True) -> dict[tuple, int]:
    """What the pool really caches: (medium, group, external hash) -> number of blocks."""
    pool = manager.block_pool
    out: dict[tuple, int] = {}
    for group in range(pool.num_kv_cache_groups):
        for block_hash, block_ids in pool.cached_hashes(group).items():
            key = (pool.medium, group, to_external_hash(block_hash, use_int))
            out[key] = out.get(key, 0) + len(block_ids)
    return out


class RandomDriver:
    """Random scheduler-like operations on one manager; `step()` does one operation."""

    def __init__(self, manager: KVCacheManager, seed: int, num_prefixes: int = 6) -> None:
        self.manager = manager
        self.rng = random.Random(seed)
        self.hasher = make_request_block_hasher(BLOCK_SIZE)
        self.prefixes = [
            [self.rng.randrange(1000) for _ in range(self.rng.randrange(4, 40))]
            for _ in range(num_prefixes)
        ]
        self.running: list[Request] = []
        self.num_requests = 0
        self.num_ops = 0

    def new_request(self) -> Request:
        rng = self.rng
        prompt = list(rng.choice(self.prefixes)) + [
            rng.randrange(1000) for _ in range(rng.randrange(1, 20))
        ]
        self.num_requests += 1
        return Request(f"req-{self.num_requests}", prompt, block_hasher=self.hasher)

    def step(self) -> None:
        self.num_ops += 1
        roll = self.rng.random()
        if roll < 0.35 or not self.running:
            self.admit(self.new_request())
        elif roll < 0.75:
            self.advance(self.rng.choice(self.running))
        elif roll < 0.9:
            self.finish(self.rng.choice(self.running))
        elif roll < 0.97:
            # Any block: free cached ones, held ones (a failed KV load), null, uncached.
            num_blocks = self.manager.block_pool.num_gpu_blocks
            self.manager.evict_blocks({self.rng.randrange(num_blocks) for _ in range(3)})
        else:
            if self.rng.random() < 0.5:
                for request in list(self.running):
                    self.finish(request)
            self.manager.reset_prefix_cache()

    def admit(self, request: Request) -> None:
        manager = self.manager
        hit = manager.get_computed_blocks(request)
        remaining = request.num_tokens - hit.num_computed_tokens
        chunk = remaining if self.rng.random() < 0.6 else self.rng.randrange(1, remaining + 1)
        blocks = manager.allocate_slots(request, chunk, hit.num_computed_tokens, hit.blocks)
        if blocks is None:
            return
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = hit.num_computed_tokens + chunk
        self.running.append(request)

    def advance(self, request: Request) -> None:
        manager = self.manager
        if request.num_computed_tokens < request.num_tokens:
            num_new = request.num_tokens - request.num_computed_tokens
        else:
            request.append_output_token_ids(self.rng.randrange(1000))
            num_new = 1
        if request.num_computed_tokens + num_new > manager.max_model_len:
            self.finish(request)
            return
        if manager.allocate_slots(request, num_new) is None:
            self.preempt(request)
            return
        request.num_computed_tokens += num_new

    def preempt(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1

    def finish(self, request: Request) -> None:
        self.manager.free(request)
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_STOPPED
