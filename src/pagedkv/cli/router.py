"""CLI: `pagedkv router serve`, the KV-aware router service in front of engine instances
(extra `[router]`). Standard library only at import time."""

from __future__ import annotations

import argparse
import sys

from pagedkv.cli._checks import examples_epilog
from pagedkv.credentials import redact

COMMAND = "router"
HELP = "KV-aware routing: serve the router over HTTP, fed by instances' KV events."
EXAMPLES = (
    "pagedkv router serve --instance-format vllm --hash-algorithm sha256_cbor \\\n"
    "      --instance gpu0=tcp://gpu0-host:5557,tcp://gpu0-host:5558 --port 8000",
    "pagedkv router serve --config router.toml",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="router_command", metavar="SUBCOMMAND")
    serve = sub.add_parser(
        "serve",
        epilog=examples_epilog(*EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        help="subscribe to N instances' event streams and answer /score, /route, /health, "
        "/ready, /metrics (docs/router.md)",
    )
    serve.add_argument("--config", metavar="FILE.toml", help="settings and [[instances]]")
    serve.add_argument(
        "--instance",
        action="append",
        default=[],
        metavar="ID=ENDPOINT[,REPLAY[,HEALTH_URL]]",
        help="an instance, its KV event endpoints and optionally its health URL (repeat; e.g. "
        "gpu0=tcp://gpu0-host:5557,tcp://gpu0-host:5558,http://gpu0-host:8000/health; IPv6: "
        "tcp://[::1]:5557)",
    )
    serve.add_argument(
        "--instance-format",
        choices=("pagedkv", "vllm"),
        default="pagedkv",
        help="publisher of the --instance streams (vllm: idempotent stores, needs "
        "--hash-algorithm sha256_cbor)",
    )
    serve.add_argument("--block-size", type=int, help="the instances' block size (default 16)")
    serve.add_argument("--hash-algorithm", help="the instances' prefix-cache hash (default sha256)")
    serve.add_argument("--index", help="memory or redis://HOST:PORT[/DB] (default memory)")
    serve.add_argument(
        "--routing-policy",
        "--policy",  # the older name, kept
        dest="policy",
        help="prefix-aware, least-loaded or round-robin (default prefix-aware)",
    )
    serve.add_argument(
        "--max-load-gap",
        metavar="N|none",
        help="prefix-aware: candidates within N in-flight requests of the least loaded (default 4)",
    )
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="listen port (default 8000; 0: any free port)")
    serve.add_argument(
        "--retry-interval-s", type=float, help="index outage retry interval (default 1)"
    )
    serve.add_argument(
        "--replay-timeout-s",
        type=float,
        help="replay progress deadline: the wait for each replayed batch (default 1)",
    )
    serve.add_argument(
        "--stale-after-s",
        type=float,
        help="an instance with no batch and no heartbeat for this long is down (default 3)",
    )
    serve.add_argument(
        "--grace-s", type=float, help="keep a down instance's entries this long (default 30)"
    )
    serve.add_argument("--seed", type=int, help="seed of the random tie-break (default 0)")
    serve.add_argument(
        "--tie-break",
        choices=("random", "first"),
        help="equally good, equally loaded instances: seeded random, or the first listed as "
        "simulate's in-process router does (default random)",
    )
    serve.add_argument("--tokenizer", metavar="DIR", help="a local tokenizer, to accept text")


def run(args: argparse.Namespace) -> int:
    if getattr(args, "router_command", None) != "serve":
        print(
            "usage: pagedkv router serve --instance ID=ENDPOINT ... (see --help)", file=sys.stderr
        )
        return 2
    from pagedkv.errors import PagedKVError

    try:
        config = _config(args)
        from pagedkv.router.service import serve

        serve(config)
    except PagedKVError as exc:
        print(f"pagedkv router serve: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except OSError as exc:  # the port is taken, an endpoint cannot be bound
        print(f"pagedkv router serve: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # SIGHUP (the service stops on SIGINT/SIGTERM itself)
        from pagedkv.cli._shutdown import exit_code

        return exit_code(exc)
    return 0


def _config(args: argparse.Namespace):  # noqa: ANN202 - lazy import of the type
    from pagedkv.errors import ConfigError
    from pagedkv.router.service_config import ServiceConfig, load_config_file, parse_instance

    gap = args.max_load_gap
    if gap is not None:
        try:
            gap = None if gap.lower() == "none" else float(gap)
        except ValueError as exc:
            raise ConfigError(f"--max-load-gap must be a number or 'none', got {gap!r}") from exc
    overrides = {
        "block_size": args.block_size,
        "hash_algorithm": args.hash_algorithm,
        "index": args.index,
        "policy": args.policy,
        "host": args.host,
        "port": args.port,
        "retry_interval_s": args.retry_interval_s,
        "replay_timeout_s": args.replay_timeout_s,
        "stale_after_s": args.stale_after_s,
        "grace_s": args.grace_s,
        "seed": args.seed,
        "tie_break": args.tie_break,
        "tokenizer": args.tokenizer,
    }
    instances = [parse_instance(spec, args.instance_format) for spec in args.instance]
    if args.config:
        if args.max_load_gap is not None:
            overrides["max_load_gap"] = gap
        if instances:
            overrides["instances"] = instances
        return load_config_file(args.config, overrides)
    settings = {k: v for k, v in overrides.items() if v is not None}
    if args.max_load_gap is not None:
        settings["max_load_gap"] = gap
    return ServiceConfig(instances=tuple(instances), **settings)
