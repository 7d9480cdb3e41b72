"""Cost per operation against pool size and concurrency (run by hand; JSON out, optional plot).

    python benchmarks/bench_scaling.py [--plot scaling.png]

Pool sweep: the same small workload (8 concurrent requests, 96-token prompts, 64 decode steps,
several rounds so freed cached blocks are evicted on reuse) on pools of 1e3 .. 1e6 blocks.
Concurrency sweep: 10 .. 1,000 running requests (256-token prompts, 64 decode steps) on a pool
sized for them. Reports µs per call of prefill (lookup + allocate), decode `allocate_slots`,
batched `allocate_decode_slots` (per request) and `free`; flat rows mean linear total cost.
"""

from __future__ import annotations

import argparse
import json
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


def run(num_blocks: int, concurrency: int, prompt_len: int, decode_steps: int, rounds: int) -> dict:
    rng = random.Random(0)
    spec = FullAttentionSpec(16, 8, 128, 2)
    manager = KVCacheManager(
        KVCacheConfig(num_blocks, [KVCacheGroupSpec(["l"], spec)]),
        max_model_len=prompt_len + decode_steps + 1,
    )
    hasher = make_request_block_hasher(16)
    totals = dict.fromkeys(("prefill", "decode", "decode_batched", "free"), 0.0)
    counts = dict.fromkeys(totals, 0)
    for round_index in range(rounds):
        batch = [
            Request(
                f"{round_index}-{i}",
                [rng.randrange(32000) for _ in range(prompt_len)],
                block_hasher=hasher,
            )
            for i in range(concurrency)
        ]
        t0 = perf_counter()
        for request in batch:
            hit = manager.get_computed_blocks(request)
            blocks = manager.allocate_slots(
                request,
                request.num_tokens - hit.num_computed_tokens,
                hit.num_computed_tokens,
                hit.blocks,
            )
            assert blocks is not None, "pool too small for the benchmark"
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = request.num_tokens
        totals["prefill"] += perf_counter() - t0
        counts["prefill"] += concurrency
        for step in range(decode_steps):
            for request in batch:
                request.append_output_token_ids(step % 32000)
            batched = step % 2 == 1
            t0 = perf_counter()
            if batched:
                assert manager.allocate_decode_slots(batch).num_allocated == concurrency
            else:
                for request in batch:
                    assert manager.allocate_slots(request, 1) is not None
            key = "decode_batched" if batched else "decode"
            totals[key] += perf_counter() - t0
            counts[key] += concurrency
            for request in batch:
                request.num_computed_tokens += 1
        t0 = perf_counter()
        for request in batch:
            manager.free(request)
        totals["free"] += perf_counter() - t0
        counts["free"] += concurrency
    return {k: round(1e6 * totals[k] / counts[k], 3) for k in totals}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plot", help="write a PNG of both sweeps (needs matplotlib)")
    parser.add_argument(
        "--no-gc",
        action="store_true",
        help="disable the cyclic GC while measuring (engines often gc.freeze(); with 1,000 live "
        "requests, GC passes otherwise dominate the growth)",
    )
    args = parser.parse_args()
    if args.no_gc:
        import gc

        gc.disable()
    pool_sweep = {
        n: run(n, concurrency=8, prompt_len=96, decode_steps=64, rounds=40)
        for n in (1_000, 10_000, 100_000, 1_000_000)
    }
    concurrency_sweep = {
        c: run(c * 24 + 100, concurrency=c, prompt_len=256, decode_steps=64, rounds=2)
        for c in (10, 100, 1_000)
    }
    result = {
        "us_per_call_by_num_blocks": pool_sweep,
        "us_per_call_by_concurrency": concurrency_sweep,
    }
    print(json.dumps(result, indent=2))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for ax, sweep, xlabel in (
            (axes[0], pool_sweep, "pool size (blocks)"),
            (axes[1], concurrency_sweep, "concurrent requests"),
        ):
            xs = list(sweep)
            for op in ("prefill", "decode", "decode_batched", "free"):
                ax.plot(xs, [sweep[x][op] for x in xs], marker="o", label=op)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("µs per request-operation")
            ax.grid(True, which="both", alpha=0.3)
        axes[0].legend()
        fig.suptitle("pagedkv: cost per operation stays flat")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
