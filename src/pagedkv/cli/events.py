"""CLI: `pagedkv events listen tcp://host:port` prints a publisher's KV events live, one line
per event, filling gaps through the replay endpoint when one is given."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

from pagedkv.cli._checks import examples_epilog, float_in, int_at_least, require_extra

COMMAND = "events"
HELP = "KV-cache events on the wire: listen to a publisher."
EXAMPLES = (
    "pagedkv events listen tcp://127.0.0.1:5557 --replay tcp://127.0.0.1:5558",
    "pagedkv events listen tcp://127.0.0.1:5557 --max-batches 10 --timeout-s 30",
)
# ZeroMQ endpoints a subscriber can connect to: tcp://host:port, ipc://path, inproc://name.
_ENDPOINT = re.compile(r"^(?:tcp://(?:\[[0-9A-Fa-f:.]+\]|[^\s:/]+):\d{1,5}|(?:ipc|inproc)://\S+)$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="events_command", metavar="SUBCOMMAND")
    listen = sub.add_parser(
        "listen",
        help="print decoded events live (Ctrl-C to stop)",
        epilog=examples_epilog(*EXAMPLES),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    listen.add_argument("endpoint", help="the publisher's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    listen.add_argument("--replay", metavar="ENDPOINT", help="its replay endpoint, for gaps")
    listen.add_argument("--topic", default="", help="topic prefix to subscribe to (default all)")
    listen.add_argument(
        "--max-batches", type=int_at_least(1), default=None, help="exit after this many batches"
    )
    listen.add_argument(
        "--timeout-s",
        type=float_in(0, open_minimum=True),
        default=None,
        help="exit after this many seconds",
    )
    listen.add_argument(
        "--sync", action="store_true", help="start from a snapshot of the publisher's cache"
    )


def _short(block_hash: Any) -> str:
    if isinstance(block_hash, bytes):
        return block_hash.hex()[:16]
    return f"{block_hash:016x}" if isinstance(block_hash, int) else repr(block_hash)


def format_event(seq: int, event: Any) -> str:
    """One line for one event (hashes as 16 hex digits)."""
    name = type(event).__name__
    head = f"seq={seq} {name}"
    if name == "BlockStored":
        parent = "-" if event.parent_block_hash is None else _short(event.parent_block_hash)
        line = (
            f"{head} group={event.group_idx} medium={event.medium} "
            f"block_size={event.block_size} parent={parent} "
            f"hashes=[{','.join(_short(h) for h in event.block_hashes)}] "
            f"num_tokens={len(event.token_ids)}"
        )
        if event.lora_name is not None:
            line += f" lora={event.lora_name}"
        return line
    if name == "BlockRemoved":
        hashes = ",".join(_short(h) for h in event.block_hashes)
        return f"{head} group={event.group_idx} medium={event.medium} hashes=[{hashes}]"
    return head


def run(args: argparse.Namespace) -> int:
    if getattr(args, "events_command", None) != "listen":
        print("usage: pagedkv events listen ENDPOINT [--replay ENDPOINT]", file=sys.stderr)
        return 2
    _check_endpoint("endpoint", args.endpoint)
    if args.replay is not None:
        _check_endpoint("--replay", args.replay)
    require_extra("events", "pagedkv events listen")
    import zmq

    from pagedkv.errors import InvalidArgumentError
    from pagedkv.wire.transport import ZmqEventSubscriber

    try:
        subscriber = ZmqEventSubscriber(args.endpoint, args.replay, topic=args.topic)
    except zmq.ZMQError as exc:
        raise InvalidArgumentError(f"cannot subscribe to {args.endpoint}: {exc}") from None
    num_batches = 0
    deadline = None if args.timeout_s is None else time.monotonic() + args.timeout_s
    try:
        print(f"listening to {args.endpoint} (Ctrl-C to stop)", file=sys.stderr, flush=True)
        if args.sync:
            snapshot = subscriber.sync()
            if snapshot is None:
                print("no snapshot available", file=sys.stderr)
            else:
                _print_batch(snapshot)
        while args.max_batches is None or num_batches < args.max_batches:
            if deadline is not None and time.monotonic() >= deadline:
                break
            for received in subscriber.poll(0.2):
                _print_batch(received)
                num_batches += 1
    except KeyboardInterrupt:
        pass
    finally:
        subscriber.close()
    print(
        f"{num_batches} batches; gaps {subscriber.num_gaps}, replayed "
        f"{subscriber.num_replayed}, snapshots {subscriber.num_snapshots}, missed "
        f"{subscriber.num_missed}, malformed {subscriber.num_malformed}",
        file=sys.stderr,
    )
    return 0


def _check_endpoint(name: str, endpoint: str) -> None:
    from pagedkv.errors import InvalidArgumentError

    match = _ENDPOINT.match(endpoint)
    port = endpoint.rsplit(":", 1)[-1] if endpoint.startswith("tcp://") else None
    if not match or (port is not None and not 1 <= int(port) <= 65535):
        raise InvalidArgumentError(
            f"{name} {endpoint!r} is not a ZeroMQ endpoint: expected tcp://HOST:PORT (e.g. "
            "tcp://127.0.0.1:5557), ipc://PATH or inproc://NAME"
        )


def _print_batch(received: Any) -> None:
    batch = received.batch
    if batch.is_snapshot:
        print(f"seq={received.seq} snapshot of {len(batch.events) - 1} stored ranges")
    for event in batch.events:
        print(format_event(received.seq, event))
    sys.stdout.flush()
