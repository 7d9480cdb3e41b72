"""`pagedkv simulate`'s cluster path: the multi-instance options (`--instances N --router ...`,
`--metrics-port`), their checks and the run; the report is `pagedkv.sim.report.cluster`'s.
Standard library only at import time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pagedkv.cli._checks import float_in, int_at_least, require_extra
from pagedkv.cli._shutdown import StopOnSignal
from pagedkv.credentials import redact
from pagedkv.router.policies import ROUTING_POLICY_NAMES

# What one simulated instance holds open (measured: 3 descriptors with inproc, 7 with tcp):
# its publisher's PUB and replay ROUTER sockets, the router's SUB and, after a gap, DEALER; a
# ZeroMQ socket is a descriptor (its mailbox) and, over tcp, a connection or listener too.
_SOCKETS_PER_INSTANCE = 4
_FILES_PER_INSTANCE = {"inproc": 4, "tcp": 8}
_FILES_BESIDES_INSTANCES = 64  # the interpreter, its libraries, ZeroMQ's I/O thread, the trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cluster (serve mode): N instances behind a router fed by their KV events over ZeroMQ"
    )
    group.add_argument(
        "--instances",
        type=int_at_least(1),
        metavar="N",
        help="simulate N instances, each with --capacity blocks (needs the [events] extra)",
    )
    group.add_argument(
        "--routing-policy",
        "--router",  # the older name, kept
        dest="router",
        choices=(*ROUTING_POLICY_NAMES, "all"),
        help="routing policy; 'all' runs each and compares them (default all, or "
        "round-robin for one instance)",
    )
    group.add_argument(
        "--max-load-gap",
        "--router-max-load-gap",  # the older name, kept
        dest="router_max_load_gap",
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
        type=int_at_least(0, 65535),
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT while the simulation runs (0: any "
        "free port; needs the [metrics] extra); implies the cluster path",
    )
    group.add_argument(
        "--metrics-linger-s",
        type=float_in(0),
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


def preflight(args: argparse.Namespace) -> None:
    """Checks before a cluster run: serve mode, the extras, and enough file descriptors and
    ZeroMQ sockets for every instance (a run that would stop with EMFILE is refused now)."""
    from pagedkv.errors import InvalidArgumentError

    if args.mode != "serve":
        raise InvalidArgumentError("--instances, --metrics-port and --index need --mode serve")
    require_extra("events", "--instances (instances publish KV events over ZeroMQ)")
    if args.metrics_port is not None:
        require_extra("metrics", "--metrics-port")
    num_instances = args.instances or 1
    limit = open_files_limit()
    num_files = _FILES_BESIDES_INSTANCES + num_instances * _FILES_PER_INSTANCE[args.event_transport]
    if limit is not None and num_files > limit:
        fit = max(
            0, (limit - _FILES_BESIDES_INSTANCES) // _FILES_PER_INSTANCE[args.event_transport]
        )
        raise InvalidArgumentError(
            f"--instances {num_instances} needs about {num_files:,} open files over "
            f"{args.event_transport}; this process may open {limit:,} (ulimit -n): raise the "
            f"limit or simulate at most {fit:,} instances"
        )
    import zmq

    max_sockets = zmq.Context.instance().get(zmq.MAX_SOCKETS)
    if num_instances * _SOCKETS_PER_INSTANCE > max_sockets:
        raise InvalidArgumentError(
            f"--instances {num_instances} needs up to {num_instances * _SOCKETS_PER_INSTANCE:,} "
            f"ZeroMQ sockets; a ZeroMQ context allows {max_sockets:,}: simulate at most "
            f"{max_sockets // _SOCKETS_PER_INSTANCE:,} instances"
        )


def open_files_limit() -> int | None:
    """This process's soft limit on open file descriptors (`ulimit -n`), None if unlimited."""
    try:
        import resource
    except ImportError:  # not a Unix system
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


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
    stop: StopOnSignal,
) -> int:
    """Run the cluster simulation and print its report; 128 + the signal if one (Ctrl-C,
    SIGTERM, SIGHUP) cut it short."""
    from pagedkv.sim.cluster import ClusterConfig, simulate_cluster
    from pagedkv.sim.report import cluster_report, render_cluster_text

    num_instances = 1 if args.instances is None else args.instances
    router = args.router or ("all" if num_instances > 1 else "round-robin")
    policies = ROUTING_POLICY_NAMES if router == "all" else (router,)
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
        with stop:
            summaries = simulate_cluster(trace, config, policies, metrics, _Offset(progress), stop)
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    report = cluster_report(
        trace,
        serve_config,
        profile_name,
        summaries,
        {
            "instances": num_instances,
            "event_transport": args.event_transport,
            "router_max_load_gap": args.router_max_load_gap,
            "index": redact(args.index),
            "router_url": None if args.router_url is None else redact(args.router_url),
        },
    )
    num_simulated = trace.num_prompt_tokens * len(policies)
    try:
        if args.json:
            sys.stdout.write(json.dumps(report, indent=2) + "\n")
            print(
                f"simulated {num_simulated:,} prompt tokens in {wall_s:.1f} s "
                f"({num_simulated / wall_s if wall_s > 0 else 0:,.0f} tokens/s)",
                file=sys.stderr,
            )
        else:
            sys.stdout.write(render_cluster_text(report, wall_s, num_simulated))
        sys.stdout.flush()
        if server is not None and args.metrics_linger_s > 0:
            time.sleep(args.metrics_linger_s)
    finally:
        if server is not None:
            server.shutdown()
    return stop.exit_code() if any(summary.get("interrupted") for summary in summaries) else 0


def _check_redis(url: str) -> None:
    """Fail fast: the server must answer before the run starts (an outage during the run is
    survived and reported)."""
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.router import IndexUnavailableError
    from pagedkv.router.redis_index import RedisPrefixIndex

    try:
        RedisPrefixIndex(url, namespace="pagedkv-sim-check").ping()
    except (IndexUnavailableError, ValueError) as exc:
        raise InvalidArgumentError(redact(f"--index {url}: {exc}")) from exc


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
