"""The owner-thread checks' cost on the hot paths, as instructions (no timing noise), run by hand.

The workload: `bench_hotpath.py`'s layouts (`single`: one full-attention group, 128 requests of
2,000 tokens with a shared 1,000-token prefix; `hybrid`: 1 full + 5 sliding-window groups, 64
requests), 64 per-call decode steps (`allocate_slots(request, 1)`), `get_computed_blocks` of
every prompt each step (single) and a `free` of every request. `setup` builds the same and
stops, so `full - setup` is the hot paths' count. Under callgrind, per tree:

    for mode in setup full; do PYTHONHASHSEED=0 PYTHONPATH=SRC valgrind --tool=callgrind \\
        --callgrind-out-file=/dev/null python benchmarks/bench_owner_check.py $mode hybrid; done

and compare `Collected` (full - setup) between a tree and its baseline (docs/design.md, Threads).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_hotpath  # noqa: E402 - the layouts and admit_all

import pagedkv  # noqa: E402


def main(mode: str, part: str) -> None:
    rng = random.Random(0)
    if part == "hybrid":
        systems = [[rng.randrange(32000) for _ in range(1024)] for _ in range(8)]
        prompts = [
            rng.choice(systems) + [rng.randrange(32000) for _ in range(976)] for _ in range(64)
        ]
        manager = bench_hotpath.hybrid_manager(pagedkv, 40000)
    else:
        spec = pagedkv.FullAttentionSpec(16, 8, 128, 2)
        config = pagedkv.KVCacheConfig(20000, (pagedkv.KVCacheGroupSpec(("layer0",), spec),))
        manager = pagedkv.KVCacheManager(config, max_model_len=4096)
        shared = [rng.randrange(32000) for _ in range(1000)]
        prompts = [shared + [rng.randrange(32000) for _ in range(1000)] for _ in range(128)]
    running = bench_hotpath.admit_all(pagedkv, manager, prompts)
    hasher = pagedkv.make_request_block_hasher(16)
    probes = [pagedkv.Request(f"p{i}", p, block_hasher=hasher) for i, p in enumerate(prompts)]
    if mode != "full":
        return
    for step in range(64):
        for request in running:
            manager.allocate_slots(request, 1)
        for request in running:
            request.num_computed_tokens += 1
            request.append_output_token_ids(step % 32000)
        if part == "single":
            for probe in probes:
                manager.get_computed_blocks(probe)
    for request in running:
        manager.free(request)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
