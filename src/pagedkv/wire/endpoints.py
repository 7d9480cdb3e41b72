"""Adapter (stdlib): ZeroMQ endpoint strings for KV events, checked before any socket exists
(a bad endpoint is one `InvalidArgumentError` naming it, never a ZeroMQ traceback)."""

from __future__ import annotations

import logging
import socket

from pagedkv.errors import InvalidArgumentError

logger = logging.getLogger("pagedkv.wire.subscriber")

_WILDCARD_HOSTS = ("*", "[::]")


def check_endpoint(endpoint: object) -> str:
    """Return `endpoint` if it is `tcp://HOST:PORT` (HOST a name, an IPv4 address, `[IPv6]` or
    `*`), `ipc://PATH` or `inproc://NAME`; else raise `InvalidArgumentError` naming it."""
    if not isinstance(endpoint, str):
        raise InvalidArgumentError(f"a ZeroMQ endpoint must be a string, got {endpoint!r}")
    if endpoint.startswith(("ipc://", "inproc://")) and endpoint.partition("://")[2]:
        return endpoint
    if not endpoint.startswith("tcp://"):
        raise InvalidArgumentError(
            f"endpoint {endpoint!r} must be tcp://HOST:PORT, ipc://PATH or inproc://NAME"
        )
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    bad_v6 = host.startswith("[") != host.endswith("]") or (":" in host and host[:1] != "[")
    if not sep or not host or bad_v6 or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise InvalidArgumentError(
            f"endpoint {endpoint!r} must be tcp://HOST:PORT with a port in 0..65535 (an IPv6 "
            "address in brackets: tcp://[::1]:5557)"
        )
    return endpoint


def should_bind_subscriber(endpoint: str) -> bool:
    """A subscriber binds only a wildcard host (`tcp://*:PORT`, `tcp://[::]:PORT`: publishers
    connect to it); every named host, IPv6 addresses included, is connected to."""
    check_endpoint(endpoint)
    if endpoint.startswith("tcp://"):
        return endpoint[len("tcp://") :].rpartition(":")[0] in _WILDCARD_HOSTS
    return False


def warn_unresolved(endpoint: str) -> bool:
    """Log one warning if a tcp endpoint names a host that does not resolve now (ZeroMQ keeps
    trying it in the background: a name that appears later still connects); True if so."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0].strip("[]")
    if host in ("*", "") or host.replace(".", "").isdigit() or ":" in host:
        return False
    try:
        socket.getaddrinfo(host, None)
    except (OSError, UnicodeError) as exc:
        logger.warning(
            "KV event endpoint %r: host %r does not resolve (%s); retrying in the background",
            endpoint,
            host,
            exc,
        )
        return True
    return False


def wants_ipv6(endpoint: str) -> bool:
    """Whether a socket for this tcp endpoint needs ZeroMQ's IPv6 option: an IPv6 address in
    brackets or a host name (which may resolve to one). IPv4 addresses and `*` keep IPv4
    sockets, so bound endpoints keep reading `tcp://0.0.0.0:PORT`, not a mapped address."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host.startswith("[") or not (host == "*" or host.replace(".", "").isdigit())
