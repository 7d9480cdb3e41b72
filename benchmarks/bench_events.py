"""Events, routing-index and overhead benchmarks (issue 5), run by hand; prints JSON.

(a) overhead: bench_core.py's serving loop and workload shapes ("decode", "shared"). Events
    off and on (take_events every step) run in lockstep, two managers stepping alternately
    in one loop, so both see the same machine load (thread CPU time, paired ratios); then
    events published over ZeroMQ (inproc, no subscriber in this process) against separate
    off runs (caller-thread and whole-process CPU).
(b) wire: batches recorded from (a) "shared", encoded and decoded in each layout; published
    end to end to a subscriber in this process.
(c) index: block-hash updates and prefix lookups per second, in memory and in Redis (a
    private redis-server on a free port, if the binary is installed).

    python benchmarks/bench_events.py [--only overhead|wire|index] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from time import perf_counter, process_time, thread_time

from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    make_request_block_hasher,
)
from pagedkv.block import to_external_hash
from pagedkv.events import BlockRemoved, BlockStored

BLOCK_SIZE = 16


WORKLOADS = {
    # bench_core.py's (b), same shape: a 4,000-token system prompt + 1,000-token suffixes,
    # batch 256, 200 decode steps, 12,000 blocks: smaller than the working set, so eviction.
    "shared": {
        "prefix_tokens": 4000, "suffix_tokens": 1000, "num_blocks": 12000,
        "num_requests": 1024, "batch": 256, "decode_steps": 200,
    },
    # bench_core.py's (a): unique 1,000-token prompts, batch 256, 200 decode steps, 20,000
    # blocks (eviction starts once finished requests' cached blocks fill the pool).
    "decode": {
        "prefix_tokens": 0, "suffix_tokens": 1000, "num_blocks": 20000,
        "num_requests": 1024, "batch": 256, "decode_steps": 200,
    },
}  # fmt: skip


class _Lane:
    """One manager of a lockstep run: the same requests, events off or on."""

    def __init__(
        self,
        events: bool,
        workload: str,
        num_requests: int,
        decode_steps: int,
        on_events: Callable[[list], None] | None = None,
    ) -> None:
        shape = WORKLOADS[workload]
        rng = random.Random(1)
        system = [rng.randrange(32000) for _ in range(shape["prefix_tokens"])]
        hasher = make_request_block_hasher(BLOCK_SIZE)
        self.requests = [
            Request(
                str(i),
                system + [rng.randrange(32000) for _ in range(shape["suffix_tokens"])],
                block_hasher=hasher,
            )
            for i in range(num_requests)
        ]
        spec = FullAttentionSpec(BLOCK_SIZE, 8, 128, 2)
        config = KVCacheConfig(shape["num_blocks"], [KVCacheGroupSpec(["layer0"], spec)])
        max_model_len = shape["prefix_tokens"] + shape["suffix_tokens"] + 2 * decode_steps
        self.manager = KVCacheManager(
            config, max_model_len=max_model_len, enable_kv_cache_events=events
        )
        self.events = events
        self.on_events = on_events  # called with each step's non-empty events, untimed here
        self.waiting = list(range(num_requests))[::-1]
        self.running: list[Request] = []
        self.decoded: dict[str, int] = {}
        self.manager_s = self.take_s = 0.0
        self.trace: list[tuple[int, ...]] = []  # block ids handed out, to check lanes agree

    def step(self, batch: int, decode_steps: int) -> None:
        manager, running, waiting = self.manager, self.running, self.waiting
        t0 = thread_time()
        manager.new_step_starts()
        index = 0
        preempted = False
        while index < len(running):
            if manager.allocate_slots(running[index], 1) is not None:
                index += 1
                continue
            victim = running.pop()
            manager.free(victim)
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            waiting.append(int(victim.request_id))
            preempted = True
        scheduled = list(running)
        admitted = []
        while not preempted and waiting and len(running) < batch:
            request = self.requests[waiting[-1]]
            hit = manager.get_computed_blocks(request)
            blocks = manager.allocate_slots(
                request, request.num_tokens - hit.num_computed_tokens, hit.num_computed_tokens,
                hit.blocks,
            )  # fmt: skip
            if blocks is None:
                break
            waiting.pop()
            request.status = RequestStatus.RUNNING
            self.decoded.setdefault(request.request_id, 0)
            running.append(request)
            admitted.append(request)
        self.manager_s += thread_time() - t0
        self.trace.append((len(running), manager.block_pool.get_num_free_blocks()))
        for request in admitted:
            request.num_computed_tokens = request.num_tokens
            request.append_output_token_ids(7)
        for request in scheduled:
            request.num_computed_tokens += 1
            self.decoded[request.request_id] += 1
            request.append_output_token_ids(7)
        keep = []
        t0 = thread_time()
        for request in running:
            if self.decoded[request.request_id] >= decode_steps:
                manager.free(request)
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            else:
                keep.append(request)
        self.manager_s += thread_time() - t0
        self.running = keep
        if self.events:
            t0 = thread_time()
            events = manager.take_events()
            self.take_s += thread_time() - t0
            if events and self.on_events is not None:
                self.on_events(events)


def serve(mode: str, workload: str = "shared") -> dict:
    """The core benchmark's synchronous loop (one `_Lane`): decode every running request,
    then admit.

    mode: "off" | "on" (events taken every step and dropped) | "publish" (and published) |
    "record" (and kept, for the wire and index benchmarks; untimed).
    Returns CPU seconds of this thread inside manager calls, in take_events and in publish
    (thread CPU time, so other processes on a shared machine do not count), the process CPU
    time of the whole loop (with the publisher thread's encoding) and wall time.
    """
    shape = WORKLOADS[workload]
    num_requests, batch, decode_steps = shape["num_requests"], shape["batch"], shape["decode_steps"]
    publisher = None
    if mode == "publish":
        from pagedkv.wire.transport import ZmqEventPublisher

        # No subscriber here: the router lives in another process; PUB drops unread data.
        publisher = ZmqEventPublisher("inproc://bench-overhead", "inproc://bench-overhead-r")
    publish_s = 0.0
    recorded: list[list] = []

    def on_events(events: list) -> None:
        nonlocal publish_s
        if publisher is not None:
            t0 = thread_time()
            publisher.publish(events)
            publish_s += thread_time() - t0
        elif mode == "record":
            recorded.append(events)

    lane = _Lane(mode != "off", workload, num_requests, decode_steps, on_events)
    gc.collect()
    wall0 = perf_counter()
    cpu0 = process_time()
    steps = 0
    while lane.waiting or lane.running:
        lane.step(batch, decode_steps)
        steps += 1
    if publisher is not None:
        while publisher.sent_batches + publisher.dropped_batches < publisher.next_seq:
            time.sleep(0.001)
    wall_s = perf_counter() - wall0
    cpu_s = process_time() - cpu0
    out = {
        "steps": steps,
        "manager_seconds": lane.manager_s,
        "take_events_seconds": lane.take_s,
        "publish_seconds": publish_s,
        "process_cpu_seconds": cpu_s,
        "wall_seconds": wall_s,
    }
    if publisher is not None:
        out["batches_published"] = publisher.sent_batches
        out["batches_dropped"] = publisher.dropped_batches
        publisher.shutdown()
    out["recorded"] = recorded
    return out


def lockstep(workload: str) -> dict:
    """Events off and on, step by step in one loop (who goes first alternates), so both see
    the same machine load: the paired ratio is robust on a shared machine."""
    shape = WORKLOADS[workload]
    num_requests, batch, decode_steps = shape["num_requests"], shape["batch"], shape["decode_steps"]
    lanes = [_Lane(False, workload, num_requests, decode_steps),
             _Lane(True, workload, num_requests, decode_steps)]  # fmt: skip
    gc.collect()
    steps = 0
    while any(lane.waiting or lane.running for lane in lanes):
        order = lanes if steps % 2 == 0 else lanes[::-1]
        for lane in order:
            lane.step(batch, decode_steps)
        steps += 1
    if lanes[0].trace != lanes[1].trace:
        raise AssertionError("events changed the allocation sequence")
    off, on = lanes
    return {
        "steps": steps,
        "off_manager_seconds": off.manager_s,
        "on_manager_seconds": on.manager_s,
        "on_take_events_seconds": on.take_s,
    }


def bench_overhead(repeats: int, workload: str) -> dict:
    """Manager path: lockstep off/on pairs (median and spread of the paired ratios).
    Publishing: separate off and publish runs, alternating (medians)."""
    pairs = [lockstep(workload) for _ in range(repeats)]
    path = sorted(p["on_manager_seconds"] / p["off_manager_seconds"] for p in pairs)
    with_take = sorted(
        (p["on_manager_seconds"] + p["on_take_events_seconds"]) / p["off_manager_seconds"]
        for p in pairs
    )
    runs: dict[str, list[dict]] = {"off": [], "publish": []}
    for _ in range(repeats):
        for mode in runs:
            result = serve(mode, workload)
            result.pop("recorded")
            runs[mode].append(result)

    def median(mode: str, *keys: str) -> float:
        return statistics.median(sum(r[k] for k in keys) for r in runs[mode])

    shape = WORKLOADS[workload]
    return {
        "workload": f"{workload}: {shape['prefix_tokens']}-token shared prefix + "
        f"{shape['suffix_tokens']}-token unique suffixes, {shape['num_requests']} requests, "
        f"batch {shape['batch']}, {shape['decode_steps']} decode steps, {shape['num_blocks']} "
        f"blocks of {BLOCK_SIZE} (bench_core.py's shape)",
        "repeats": repeats,
        "lockstep_median_seconds": {
            key: round(statistics.median(p[key] for p in pairs), 4) for key in pairs[0]
        },
        "manager_path_ratio_on_vs_off": {
            "median": round(statistics.median(path), 4),
            "min": round(path[0], 4),
            "max": round(path[-1], 4),
        },
        "with_take_events_ratio": {
            "median": round(statistics.median(with_take), 4),
            "min": round(with_take[0], 4),
            "max": round(with_take[-1], 4),
        },
        "publish_median_seconds": {
            mode: {k: round(statistics.median(r[k] for r in rs), 4) for k in rs[0]}
            for mode, rs in runs.items()
        },
        "publish_caller_thread_ratio": round(
            median("publish", "manager_seconds", "take_events_seconds", "publish_seconds")
            / median("off", "manager_seconds"),
            4,
        ),
        "publish_process_cpu_ratio_whole_loop": round(
            median("publish", "process_cpu_seconds") / median("off", "process_cpu_seconds"), 4
        ),
    }


def count_hashes(batches: list[list]) -> tuple[int, int]:
    num_events = sum(len(b) for b in batches)
    num_hashes = sum(len(e.block_hashes) for b in batches for e in b if hasattr(e, "block_hashes"))
    return num_events, num_hashes


def bench_wire(batches: list[list]) -> dict:
    from pagedkv.wire import EventBatch, EventDecoder, EventEncoder
    from pagedkv.wire.transport import ZmqEventPublisher, ZmqEventSubscriber

    num_events, num_hashes = count_hashes(batches)
    out: dict = {"batches": len(batches), "events": num_events, "block_hashes": num_hashes}
    decoder = EventDecoder()
    for layout in ("map", "array"):
        for hash_format in ("int64", "bytes"):
            encoder = EventEncoder(layout, hash_format)
            wrapped = [EventBatch(1.0, events, 0) for events in batches]
            t0 = perf_counter()
            payloads = [encoder.encode(b) for b in wrapped]
            encode_s = perf_counter() - t0
            t0 = perf_counter()
            for payload in payloads:
                decoder.decode(payload)
            decode_s = perf_counter() - t0
            out[f"{layout}_{hash_format}"] = {
                "encode_events_per_s": round(num_events / encode_s),
                "decode_events_per_s": round(num_events / decode_s),
                "bytes_per_block_hash": round(sum(map(len, payloads)) / num_hashes, 1),
            }
    # End to end: publish() -> background encode -> PUB -> SUB -> decoded, inproc.
    with ZmqEventPublisher("inproc://bench-wire", "inproc://bench-wire-r") as publisher:
        subscriber = ZmqEventSubscriber("inproc://bench-wire", "inproc://bench-wire-r")
        time.sleep(0.05)
        got = 0
        t0 = perf_counter()
        for events in batches:
            publisher.publish(events)
        while got < len(batches) and perf_counter() - t0 < 60:
            got += len(subscriber.poll(0.05))
        elapsed = perf_counter() - t0
        subscriber.close()
        out["publish_end_to_end"] = {
            "batches_received": got,
            "events_per_s": round(num_events / elapsed),
            "batches_per_s": round(len(batches) / elapsed),
            "dropped": publisher.dropped_batches,
        }
    return out


def _start_redis() -> tuple[subprocess.Popen, str] | None:
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="bench-redis-")
    process = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", workdir],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)
    return process, f"redis://127.0.0.1:{port}/0"


def bench_index(batches: list[list]) -> dict:
    from pagedkv.router import InMemoryPrefixIndex

    # Eight instances, each replaying the recorded stream (int64 hashes, as on the wire).
    external = []
    for events in batches:
        converted = []
        for event in events:
            if isinstance(event, (BlockStored, BlockRemoved)):
                hashes = [to_external_hash(h) for h in event.block_hashes]
                event = BlockRemoved(hashes, event.medium, event.group_idx) if isinstance(
                    event, BlockRemoved
                ) else BlockStored(hashes, None, [], event.block_size, None, event.medium,
                                   group_idx=event.group_idx)  # fmt: skip
            converted.append(event)
        external.append(converted)
    _, num_hashes = count_hashes(external)
    instances = [f"i{n}" for n in range(8)]
    # Probes: the recorded workload's system prompt (the same seed) + a fresh suffix, so a
    # lookup walks the whole cached prefix on every instance before it misses.
    rng = random.Random(1)
    system = [rng.randrange(32000) for _ in range(WORKLOADS["shared"]["prefix_tokens"])]
    rng = random.Random(3)
    hasher = make_request_block_hasher(BLOCK_SIZE)
    probes = [
        [to_external_hash(h) for h in Request(
            "p", system + [rng.randrange(32000) for _ in range(300)], block_hasher=hasher
        ).block_hashes]
        for _ in range(20)
    ]  # fmt: skip
    out: dict = {"instances": len(instances), "lookup_blocks": len(probes[0])}

    def measure(index, label: str, num_lookups: int) -> None:
        t0 = perf_counter()
        for instance_id in instances:
            for events in external:
                index.apply_events(instance_id, events)
        update_s = perf_counter() - t0
        t0 = perf_counter()
        matched = 0
        for n in range(num_lookups):
            matched += max(index.match_lengths(probes[n % len(probes)], instances).values())
        lookup_s = perf_counter() - t0
        out[label] = {
            "hash_updates_per_s": round(len(instances) * num_hashes / update_s),
            "lookups_per_s": round(num_lookups / lookup_s, 1),
            "mean_matched_blocks": round(matched / num_lookups, 1),
        }

    measure(InMemoryPrefixIndex(), "in_memory", 2000)
    started = _start_redis()
    if started is None:
        out["redis"] = "skipped: redis-server not installed"
    else:
        process, url = started
        try:
            from pagedkv.router.redis_index import RedisPrefixIndex

            measure(RedisPrefixIndex(url, namespace="bench"), "redis", 200)
        finally:
            process.terminate()
            process.wait()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["overhead", "wire", "index"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    result: dict = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "cpus": __import__("os").cpu_count(),
    }
    if args.only in (None, "overhead"):
        result["overhead"] = {
            workload: bench_overhead(args.repeats, workload) for workload in WORKLOADS
        }
    recorded = serve("record")["recorded"] if args.only != "overhead" else []
    if args.only in (None, "wire"):
        result["wire"] = bench_wire(recorded)
    if args.only in (None, "index"):
        result["index"] = bench_index(recorded)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
