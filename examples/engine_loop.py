"""A minimal engine loop on pagedkv's KVCacheManager: what your scheduler does each step, with
a fake model (docs/integration.md walks through it).

Three requests share a 32-token system prompt; the pool is small, so the last one waits and a
running one is preempted once. Each step prints what the model would be given: per request,
the tokens it computes and the KV-cache slots (block id * block size + offset) it writes.

    python examples/engine_loop.py
"""

from __future__ import annotations

from collections import deque

from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    make_request_block_hasher,
)

BLOCK_SIZE = 4
MAX_TOKENS = 6  # output tokens per request


def slot_mapping(block_ids: list[int], start: int, num_tokens: int) -> list[int]:
    """KV-cache slots of tokens [start, start + num_tokens): block id * block size + offset."""
    return [
        block_ids[position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE
        for position in range(start, start + num_tokens)
    ]


def runs(slots: list[int]) -> str:
    """Slots as contiguous runs: 4-37, 44."""
    out, start = [], slots[0]
    for previous, slot in zip(slots, [*slots[1:], None], strict=True):
        if slot != previous + 1:
            out.append(f"{start}-{previous}" if previous != start else f"{start}")
            start = slot
    return ", ".join(out)


def fake_model(batch: list[tuple[Request, int]]) -> dict[str, int]:
    """One sampled token per request whose tokens are now all computed (a real model here)."""
    return {request.request_id: 1000 + request.num_tokens for request, _ in batch}


def main() -> None:
    # 1. The cache: one group of full-attention layers, 11 usable blocks (0 is the null block).
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=2, head_size=8, dtype_bytes=2)
    config = KVCacheConfig(num_blocks=12, kv_cache_groups=[KVCacheGroupSpec(["layers"], spec)])
    manager = KVCacheManager(config, max_model_len=64, enable_kv_cache_events=True)
    hasher = make_request_block_hasher(hash_block_size=BLOCK_SIZE)

    system_prompt = list(range(32))
    waiting: deque[Request] = deque(
        Request(request_id, system_prompt + suffix, block_hasher=hasher)
        for request_id, suffix in (("a", [100, 101]), ("b", [200]), ("c", [300, 301, 302]))
    )
    running: list[Request] = []

    def preempt(victim: Request) -> None:
        """Recompute later: free its blocks (they stay cached) and put it back first in line."""
        running.remove(victim)
        manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        waiting.appendleft(victim)
        print(f"  preempted {victim.request_id}")

    step = 0
    while waiting or running:
        step += 1
        print(f"step {step}")
        batch: list[tuple[Request, int]] = []  # (request, tokens computed this step)
        # 2. Decode: one more token for each running request. No room: preempt the newest.
        for request in list(running):
            if request not in running:
                continue  # preempted to make room for an older one
            while manager.allocate_slots(request, 1) is None:
                preempt(running[-1])
                if request not in running:
                    break
            else:
                batch.append((request, 1))
        # 3. Prefill: admit waiting requests while their prompts fit (nothing was preempted).
        while waiting and len(batch) == len(running):
            request = waiting[0]
            hit = manager.get_computed_blocks(request)  # the longest cached prefix
            num_new = request.num_tokens - hit.num_computed_tokens
            if (
                manager.allocate_slots(request, num_new, hit.num_computed_tokens, hit.blocks)
                is None
            ):
                break  # not enough free blocks: it waits
            waiting.popleft()
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = hit.num_computed_tokens
            running.append(request)
            batch.append((request, num_new))
        # 4. The forward pass: tokens and the slots their K/V go to.
        for request, num_tokens in batch:
            block_ids = manager.get_block_ids(request.request_id)[0]
            slots = slot_mapping(block_ids, request.num_computed_tokens, num_tokens)
            tokens = "1 token" if num_tokens == 1 else f"{num_tokens} tokens"
            print(
                f"  {request.request_id}: {tokens} from position {request.num_computed_tokens}"
                f", slots {runs(slots)}; blocks {block_ids}"
            )
        sampled = fake_model(batch)
        # 5. After the step: count the computed tokens, append the sampled token, finish.
        for request, num_tokens in batch:
            request.num_computed_tokens += num_tokens
            request.append_output_token_ids(sampled[request.request_id])
            if request.num_output_tokens == MAX_TOKENS:
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                running.remove(request)
                manager.free(request)  # its full blocks stay cached for the next prompt
                print(f"  {request.request_id} finished: {request.output_token_ids}")
        # 6. KV events for a router (BlockStored / BlockRemoved), once a step.
        events = manager.take_events()
        if events:
            kinds = [type(event).__name__ for event in events]
            print(f"  events: {', '.join(kinds)}")
        manager.check_invariants()


if __name__ == "__main__":
    main()
