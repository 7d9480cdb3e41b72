"""CLI helper of `pagedkv simulate`: the multi-instance options and report (`--instances N
--router ...`, `--metrics-port`). Not a command itself (the leading underscore); standard
library only at import time."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cluster (serve mode): N instances behind a router fed by their KV events over ZeroMQ"
    )
    group.add_argument(
        "--instances",
        type=int,
        metavar="N",
        help="simulate N instances, each with --capacity blocks (needs the [events] extra)",
    )
    group.add_argument(
        "--router",
        choices=(*ROUTERS, "all"),
        help="routing policy; 'all' runs each and compares them (default: all, or "
        "round-robin for one instance)",
    )
    group.add_argument(
        "--router-max-load-gap",
        type=_gap,
        default=4.0,
        metavar="N|none",
        help="prefix-aware: only instances within N unfinished requests of the least loaded "
        "are candidates (default 4; none: pure prefix scoring)",
    )
    group.add_argument(
        "--index",
        default="memory",
        metavar="memory|redis://HOST:PORT[/DB]",
        help="where the router keeps its prefix index (default memory; redis needs the "
        "[router] extra and a reachable server)",
    )
    group.add_argument(
        "--router-url",
        metavar="http://HOST:PORT",
        help="route through this running `pagedkv router serve` (its instances' endpoints "
        "are where the simulated instances publish; docs/router.md)",
    )
    group.add_argument(
        "--event-transport",
        choices=("inproc", "tcp"),
        default="inproc",
        help="ZeroMQ transport between instances and router (default inproc; tcp: loopback)",
    )
    group.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT while the simulation runs (0: any "
        "free port; needs the [metrics] extra); implies the cluster path",
    )
    group.add_argument(
        "--metrics-linger-s",
        type=float,
        default=0.0,
        metavar="S",
        help="keep serving metrics S seconds after the run (default 0)",
    )


def _gap(text: str) -> float | None:
    if text.lower() == "none":
        return None
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'none', got {text!r}")
    return value


def wanted(args: argparse.Namespace) -> bool:
    """Whether the multi-instance path runs (serve mode with --instances, --metrics-port or
    --index)."""
    return (
        args.instances is not None
        or args.metrics_port is not None
        or args.index != "memory"
        or args.router_url is not None
    )


def run(
    args: argparse.Namespace,
    trace: Any,
    serve_config: Any,
    profile_name: str | None,
    make_progress: Any,
) -> int:
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.sim.cluster import ClusterConfig, simulate_cluster
    from pagedkv.sim.report import serve_report
    from pagedkv.sim.serve import ServeResult

    if args.mode != "serve":
        raise InvalidArgumentError("--instances, --metrics-port and --index need --mode serve")
    if args.plot:
        raise InvalidArgumentError("--plot is not available with --instances/--metrics-port")
    num_instances = 1 if args.instances is None else args.instances
    if num_instances < 1:
        raise InvalidArgumentError(f"--instances must be >= 1, got {num_instances}")
    router = args.router or ("all" if num_instances > 1 else "round-robin")
    policies = ROUTERS if router == "all" else (router,)
    index_url = None if args.index == "memory" else args.index
    config = ClusterConfig(
        serve_config,
        num_instances,
        args.event_transport,
        max_load_gap=args.router_max_load_gap,
        index_url=index_url,
        router_url=args.router_url,
    )
    if index_url is not None:
        _check_redis(index_url)
    metrics = server = None
    if args.metrics_port is not None:
        from pagedkv.metrics import KVCacheMetrics, start_http_server

        metrics = KVCacheMetrics()
        server = start_http_server(metrics, args.metrics_port)
        print(f"metrics on http://127.0.0.1:{server.port}/metrics", file=sys.stderr, flush=True)
    progress = make_progress(len(trace.requests) * len(policies), "serving (cluster)")
    start = time.perf_counter()
    try:
        summaries = simulate_cluster(trace, config, policies, metrics, _Offset(progress))
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    base = serve_report(trace, serve_config, profile_name, ServeResult(summary={}))
    report = {
        "format": base["format"],
        "mode": "cluster",
        "trace": base["trace"],
        "config": {
            **base["config"],
            "instances": num_instances,
            "event_transport": args.event_transport,
            "router_max_load_gap": args.router_max_load_gap,
            "index": args.index,
            "router_url": args.router_url,
        },
        "results": summaries,
    }
    try:
        if args.json:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
        else:
            sys.stdout.write(render_text(report, wall_s))
        sys.stdout.flush()
        if server is not None and args.metrics_linger_s > 0:
            time.sleep(args.metrics_linger_s)
    finally:
        if server is not None:
            server.shutdown()
    return 0


def _check_redis(url: str) -> None:
    """Fail fast: the server must answer before the run starts (an outage during the run is
    survived and reported)."""
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.router import IndexUnavailableError
    from pagedkv.router.redis_index import RedisPrefixIndex

    try:
        RedisPrefixIndex(url, namespace="pagedkv-sim-check").ping()
    except (IndexUnavailableError, ValueError) as exc:
        raise InvalidArgumentError(f"--index {url}: {exc}") from exc


class _Offset:
    """Progress over several policies: each run reports from zero."""

    def __init__(self, progress: Any) -> None:
        self.progress = progress
        self.base = 0
        self.last = 0

    def __call__(self, num_done: int) -> None:
        if num_done < self.last:
            self.base += self.last
        self.last = num_done
        self.progress(self.base + num_done)


def render_text(report: dict[str, Any], wall_s: float) -> str:
    trace, config = report["trace"], report["config"]
    lines = [
        f"pagedkv simulate (cluster): {trace['name']}: {trace['num_requests']:,} requests, "
        f"{config['instances']} instances x {config['num_blocks']:,} blocks, events over "
        f"{config['event_transport']} ZeroMQ",
        "",
        f"{'router':<14}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p99':>11}{'e2e p50':>10}"
        f"{'req/s':>8}  {'requests per instance':<24}{'max/mean busy':>14}",
    ]
    for result in report["results"]:
        balance = result["load_balance"]
        per_instance = ",".join(str(n) for n in balance["requests_per_instance"])
        lines.append(
            f"{result['router']:<14}"
            f"{100 * result['prefix_cache']['hit_rate']:>9.2f}%"
            f"{result['ttft_s']['p50']:>10.3f}s"
            f"{result['ttft_s']['p99']:>10.3f}s"
            f"{result['e2e_latency_s']['p50']:>9.2f}s"
            f"{result['throughput']['requests_per_s']:>8.2f}  "
            f"{per_instance:<24}{balance['busy_time_max_over_mean']:>14.2f}"
        )
    matches = [r["routing"]["index_matches_pools"] for r in report["results"]]
    if None in matches:
        consistent = "unknown (the index is unavailable)"
    else:
        consistent = "yes" if all(matches) else "NO"
    lines += [
        "",
        "hit rate: prefix-cache token hit rate over all instances; busy: simulated step time",
        f"router index equals every instance's cache at the end: {consistent}",
    ]
    if config.get("index", "memory") != "memory":
        lines.append(f"router index in {config['index']}")
    for result in report["results"]:
        routing = result["routing"]
        if routing.get("index_outages") or routing["fallback_decisions"]:
            lines.append(
                f"{result['router']}: index unavailable {routing['index_outages']} time(s), "
                f"{routing['index_recoveries']} recovered; {routing['fallback_decisions']} "
                f"routing decisions fell back to least-loaded"
            )
    lines += [f"simulator speed: {wall_s:.1f} s wall", ""]
    return "\n".join(lines)
