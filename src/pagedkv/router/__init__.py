"""Router: a cluster-wide prefix index fed by KV events, and cache-aware request routing.

Stdlib only, except `RedisPrefixIndex` (extra `[router]`), imported on first access.
"""

from __future__ import annotations

from typing import Any

from pagedkv.router.index import (
    IndexLostError,
    IndexUnavailableError,
    InMemoryPrefixIndex,
    PrefixIndex,
)
from pagedkv.router.policies import (
    POLICY_NAMES,
    ROUTING_POLICY_NAMES,
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from pagedkv.router.router import (
    InstanceState,
    Router,
    RoutingDecision,
    external_events,
    request_block_hashes,
)

__all__ = [
    "POLICY_NAMES",
    "ROUTING_POLICY_NAMES",
    "IndexLostError",
    "IndexUnavailableError",
    "InstanceState",
    "InMemoryPrefixIndex",
    "LeastLoadedPolicy",
    "PrefixAwarePolicy",
    "PrefixIndex",
    "RedisPrefixIndex",
    "RoundRobinPolicy",
    "Router",
    "RoutingDecision",
    "RoutingPolicy",
    "external_events",
    "make_policy",
    "request_block_hashes",
]


def __getattr__(name: str) -> Any:
    if name == "RedisPrefixIndex":
        from pagedkv.router.redis_index import RedisPrefixIndex

        return RedisPrefixIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
