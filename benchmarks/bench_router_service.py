"""End-to-end load on `pagedkv router serve`: the shipped Mooncake conversation trace against 8
simulated instances.

1. Record (untimed): serve the trace on 8 simulated instances (prefix-aware routing in
   process) and keep every event batch each instance published, as wire payloads, and every
   routed prompt.
2. Replay (timed): start the service as a subprocess on loopback, subscribed to 8 publishers
   in this process that replay the recorded payloads in their recorded order, while
   `--concurrency` client tasks send the trace's prompts to /route (token ids, the
   service tracks load in flight, each request released at once) as fast as it answers.

Prints JSON: routed requests per second, client-side latency p50/p99, the batches and block
updates the service applied per second, its own score-time histogram, and whether the index
was exact at the end.

    python benchmarks/bench_router_service.py [--num-requests 1000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from pagedkv.sched import SchedulerConfig
from pagedkv.sim.cluster import ClusterConfig, simulate_cluster
from pagedkv.sim.cost_model import DEFAULT_PROFILE, get_profile
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.serve import ServeConfig
from pagedkv.wire import EventEncoder
from pagedkv.wire.transport import ZmqEventPublisher

NUM_INSTANCES = 8
TRACE = Path(__file__).resolve().parents[1] / "src/pagedkv/data/mooncake_conversation_sample.jsonl"


def record(num_requests: int) -> tuple[list[list[bytes]], list[list[int]]]:
    """Serve the trace once in process; return each instance's payloads and every prompt."""
    payloads: dict[str, list[bytes]] = {}
    encoder = EventEncoder()
    original = ZmqEventPublisher.publish

    def recording_publish(self, batch):  # noqa: ANN001, ANN202 - a benchmark's hook
        payloads.setdefault(self._requested_endpoint, []).append(encoder.encode(batch))
        return original(self, batch)

    trace = load_trace(TRACE, limit=num_requests)
    serve = ServeConfig(
        num_blocks=20_000,
        cost_model=get_profile(DEFAULT_PROFILE).cost_model(),
        scheduler=SchedulerConfig(max_model_len=131_072),
        max_model_len=131_072,
    )
    ZmqEventPublisher.publish = recording_publish  # type: ignore[method-assign]
    try:
        simulate_cluster(trace, ClusterConfig(serve, NUM_INSTANCES), ["prefix-aware"])
    finally:
        ZmqEventPublisher.publish = original  # type: ignore[method-assign]
    streams = [payloads[key] for key in sorted(payloads, key=lambda k: int(k.rsplit("-", 1)[1]))]
    prompts = [request.prompt_token_ids() for request in trace.requests]
    return streams, prompts


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for sock in sockets:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in sockets]
    for sock in sockets:
        sock.close()
    return ports


def start_service(ports: list[int], http_port: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "pagedkv", "router", "serve", "--port", str(http_port)]
    for n in range(NUM_INSTANCES):
        pub, replay = ports[2 * n], ports[2 * n + 1]
        args += ["--instance", f"i{n}=tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"]
    service = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    service.stdout.readline()
    assert service.stdout.readline().startswith("listening on"), service.stderr.read()
    return service


def replay_publishers(
    streams: list[list[bytes]], ports: list[int], ready: threading.Event,
    stop: threading.Event, done: list[float],
) -> None:  # fmt: skip
    """8 PUB sockets (bound where the service connects) sending the recorded payloads, and
    replay sockets answering gap requests until `stop` (no snapshots, as vLLM)."""
    context = zmq.Context.instance()
    pubs, routers = [], []
    for n in range(NUM_INSTANCES):
        pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 0)
        pub.bind(f"tcp://127.0.0.1:{ports[2 * n]}")
        router = context.socket(zmq.ROUTER)
        router.bind(f"tcp://127.0.0.1:{ports[2 * n + 1]}")
        pubs.append(pub)
        routers.append(router)
    ready.wait()
    start = time.perf_counter()
    cursors = [0] * NUM_INSTANCES
    end_marker = (-1).to_bytes(8, "big", signed=True)
    while not stop.is_set():
        for n, stream in enumerate(streams):
            for _ in range(8):  # interleave the instances, 8 batches at a time
                if cursors[n] < len(stream):
                    pubs[n].send_multipart([b"", cursors[n].to_bytes(8, "big"), stream[cursors[n]]])
                    cursors[n] += 1
                    if all(c == len(s) for c, s in zip(cursors, streams, strict=True)):
                        done.append(time.perf_counter() - start)
            while routers[n].poll(0):
                client, _, request = routers[n].recv_multipart()
                first = int.from_bytes(request, "big") if len(request) == 8 else len(stream)
                for seq in range(first, cursors[n]):
                    routers[n].send_multipart([client, b"", b"", seq.to_bytes(8, "big"),
                                               stream[seq]])  # fmt: skip
                routers[n].send_multipart([client, b"", b"", end_marker, b""])
        time.sleep(0.001)
    for sock in pubs + routers:
        sock.close(linger=0)


async def load(url: str, prompts: list[list[int]], concurrency: int) -> dict:
    import aiohttp

    latencies: list[float] = []
    fallbacks = 0
    queue: asyncio.Queue = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal fallbacks
        while not queue.empty():
            prompt = queue.get_nowait()
            start = time.perf_counter()
            async with session.post(url + "/route", json={"token_ids": prompt}) as response:
                answer = await response.json()
            latencies.append(time.perf_counter() - start)
            fallbacks += answer["fallback"]
            async with session.post(url + "/release", json={"instance": answer["instance"]}):
                pass

    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
    elapsed = time.perf_counter() - start
    latencies.sort()
    return {
        "routed": len(latencies),
        "routed_per_s": round(len(latencies) / elapsed, 1),
        "latency_ms_p50": round(1e3 * statistics.median(latencies), 2),
        "latency_ms_p99": round(1e3 * latencies[int(0.99 * (len(latencies) - 1))], 2),
        "fallback_decisions": fallbacks,
        "wall_s": round(elapsed, 2),
    }


def caught_up(url: str, streams: list[list[bytes]], timeout_s: float = 120.0) -> None:
    """Wait until the service has seen every recorded batch."""
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = json.loads(urllib.request.urlopen(url + "/health", timeout=30).read())
        seqs = [state["last_seq"] for state in health["instances"].values()]
        if seqs == [len(stream) - 1 for stream in streams]:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the service did not catch up: {seqs}")


def scrape(url: str) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"^(pagedkv_router_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if match:
            out[match[1]] = out.get(match[1], 0.0) + float(match[3])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    streams, prompts = record(args.num_requests)
    num_batches = sum(len(s) for s in streams)
    ports = free_ports(2 * NUM_INSTANCES + 1)
    http_port = ports.pop()
    ready, stop, done = threading.Event(), threading.Event(), []
    publisher = threading.Thread(target=replay_publishers, args=(streams, ports, ready, stop, done))
    publisher.start()
    service = start_service(ports, http_port)
    url = f"http://127.0.0.1:{http_port}"
    try:
        time.sleep(1.0)  # the subscriptions reach the publishers
        before = scrape(url)
        ready.set()
        start = time.perf_counter()
        result = asyncio.run(load(url, prompts, args.concurrency))
        caught_up(url, streams)
        events_s = time.perf_counter() - start
        after = scrape(url)
    finally:
        stop.set()
        publisher.join()
        service.terminate()
        service.wait(timeout=10)
    applied = after["pagedkv_router_events_applied_total"] - before.get(
        "pagedkv_router_events_applied_total", 0
    )
    score_us = (
        1e6
        * after["pagedkv_router_score_seconds_sum"]
        / max(1, after["pagedkv_router_score_seconds_count"])
    )
    print(json.dumps({
        "python": sys.version.split()[0], "machine": platform.machine(), "cpus": os.cpu_count(),
        "loadavg": os.getloadavg(), "instances": NUM_INSTANCES, "requests": len(prompts),
        "mean_prompt_tokens": round(statistics.mean(len(p) for p in prompts)),
        "event_batches": num_batches, "events_applied": int(applied),
        "events_applied_per_s_while_routing": round(applied / events_s),
        "publish_s": round(done[0], 2) if done else None,
        "route": result,
        "service_index_score_us_mean": round(score_us, 1),
        "index_exact_at_end": bool(after.get("pagedkv_router_index_exact")),
        "lost_batches": int(after.get("pagedkv_router_lost_batches_total", 0)),
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
