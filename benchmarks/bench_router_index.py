"""Router index speed: block updates applied per second and the latency of scoring a
4,000-token request (250 blocks of 16) against 8 instances, in process.

The event stream is bench_events.py's recorded shared-prefix workload (one `KVCacheManager`
serving 1,024 requests with a 4,000-token system prompt), in the wire's int64 hash form,
replayed once per instance. Times are process CPU time (`time.process_time`), medians of
`--repeats` runs, so a loaded machine inflates them less than wall time. Prints JSON.

    python benchmarks/bench_router_index.py [--repeats 5] [--redis]

With --redis, the Redis index too, against a redis-server it starts (wall time, one instance's
stream applied, then the same score).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_events  # noqa: E402

from pagedkv.block import to_external_hash  # noqa: E402
from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

NUM_INSTANCES = 8
SCORE_BLOCKS = 250  # 4,000 tokens at block size 16


def recorded_stream() -> tuple[list[list], int]:
    """The workload's event batches with int64 hashes, and its number of block updates."""
    batches = bench_events.serve("record")["recorded"]
    out: list[list] = []
    num_updates = 0
    for events in batches:
        converted: list = []
        for event in events:
            if type(event) is BlockStored:
                hashes = [to_external_hash(h) for h in event.block_hashes]
                converted.append(
                    BlockStored(
                        hashes,
                        None,
                        [],
                        event.block_size,
                        None,
                        event.medium,
                        group_idx=event.group_idx,
                    )
                )
                num_updates += len(hashes)
            elif type(event) is BlockRemoved:
                hashes = [to_external_hash(h) for h in event.block_hashes]
                converted.append(BlockRemoved(hashes, event.medium, event.group_idx))
                num_updates += len(hashes)
            elif type(event) is AllBlocksCleared:
                converted.append(event)
        out.append(converted)
    return out, num_updates


def measure_apply(make_index, stream: list[list], num_updates: int, repeats: int) -> dict:
    instances = [f"i{n}" for n in range(NUM_INSTANCES)]
    rates = []
    for _ in range(repeats):
        index = make_index()
        start = time.process_time()
        for instance_id in instances:
            for events in stream:
                index.apply_events(instance_id, events)
        rates.append(NUM_INSTANCES * num_updates / (time.process_time() - start))
    return {
        "block_updates_per_s_median": round(statistics.median(rates)),
        "block_updates_per_s_runs": [round(r) for r in rates],
    }


def measure_score(make_index, repeats: int, num_calls: int = 2000) -> dict:
    """Worst case: every instance caches the whole request, so the walk visits all blocks."""
    index = make_index()
    instances = [f"i{n}" for n in range(NUM_INSTANCES)]
    hashes = [(n * 0x9E3779B97F4A7C15) & (2**64 - 1) for n in range(1, SCORE_BLOCKS + 1)]
    for instance_id in instances:
        index.apply_events(instance_id, [BlockStored(hashes, None, [], 16, None, "GPU", 0)])
    assert index.match_lengths(hashes, instances) == dict.fromkeys(instances, SCORE_BLOCKS)
    runs = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(num_calls):
            index.match_lengths(hashes, instances)
        runs.append((time.process_time() - start) / num_calls * 1e6)
    return {
        "score_us_median": round(statistics.median(runs), 1),
        "score_us_runs": [round(r, 1) for r in runs],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--redis", action="store_true", help="also a local redis-server")
    args = parser.parse_args()
    from pagedkv.router import InMemoryPrefixIndex

    stream, num_updates = recorded_stream()
    result = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "instances": NUM_INSTANCES,
        "block_updates_per_instance": num_updates,
        "score_blocks": SCORE_BLOCKS,
        "in_memory": {
            **measure_apply(InMemoryPrefixIndex, stream, num_updates, args.repeats),
            **measure_score(InMemoryPrefixIndex, args.repeats),
        },
    }
    if args.redis:
        result["redis"] = measure_redis(stream, num_updates)
    print(json.dumps(result, indent=2))
    return 0


def measure_redis(stream: list[list], num_updates: int) -> dict | str:
    """The Redis index against a local server (wall time: the server does the work)."""
    started = bench_events._start_redis()
    if started is None:
        return "skipped: redis-server not installed"
    process, url = started
    try:
        from pagedkv.router.redis_index import RedisPrefixIndex

        index = RedisPrefixIndex(url, namespace="bench", socket_timeout_s=30)
        start = time.perf_counter()
        for events in stream:
            index.apply_events("i0", events)
        updates_per_s = num_updates / (time.perf_counter() - start)
        instances = [f"i{n}" for n in range(NUM_INSTANCES)]
        hashes = [(n * 0x9E3779B97F4A7C15) & (2**64 - 1) for n in range(1, SCORE_BLOCKS + 1)]
        for instance_id in instances:
            index.apply_events(instance_id, [BlockStored(hashes, None, [], 16, None, "GPU", 0)])
        start = time.perf_counter()
        for _ in range(200):
            index.match_lengths(hashes, instances)
        return {
            "block_updates_per_s": round(updates_per_s),
            "score_us": round((time.perf_counter() - start) / 200 * 1e6, 1),
        }
    finally:
        process.terminate()
        process.wait()


if __name__ == "__main__":
    sys.exit(main())
