"""Pool memory and build time at scale (run by hand; prints JSON).

    python benchmarks/bench_memory.py [--num-blocks 1000000]

Bytes per block are measured with tracemalloc around building a `BlockPool` (blocks, their
ids, the pool's list and the free-queue links); build time is the best of three.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tracemalloc
from time import perf_counter

from pagedkv.block_pool import BlockPool


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-blocks", type=int, default=1_000_000)
    args = parser.parse_args()
    gc.collect()
    tracemalloc.start()
    pool = BlockPool(args.num_blocks)
    current_bytes, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del pool
    build_seconds = []
    for _ in range(3):
        gc.collect()
        t0 = perf_counter()
        pool = BlockPool(args.num_blocks)
        build_seconds.append(perf_counter() - t0)
        del pool
    print(
        json.dumps(
            {
                "python": sys.version.split()[0],
                "num_blocks": args.num_blocks,
                "bytes_per_block": round(current_bytes / args.num_blocks, 1),
                "build_seconds_best": round(min(build_seconds), 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
