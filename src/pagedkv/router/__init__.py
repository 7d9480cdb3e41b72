"""Router: a cluster-wide prefix index fed by KV events, and cache-aware request routing.

Stdlib only, except `RedisPrefixIndex` (extra `[router]`), imported on first access.
"""

from __future__ import annotations

from typing import Any

from pagedkv.router.index import IndexUnavailableError, InMemoryPrefixIndex, PrefixIndex
from pagedkv.router.policies import (
    POLICY_NAMES,
    LeastLoadedPolicy,
    PrefixAwarePolicy,
    RoundRobinPolicy,
    RoutingPolicy,
    make_policy,
)
from pagedkv.router.router import Router, RoutingDecision, request_block_hashes

__all__ = [
    "POLICY_NAMES",
    "IndexUnavailableError",
    "InMemoryPrefixIndex",
    "LeastLoadedPolicy",
    "PrefixAwarePolicy",
    "PrefixIndex",
    "RedisPrefixIndex",
    "RoundRobinPolicy",
    "Router",
    "RoutingDecision",
    "RoutingPolicy",
    "make_policy",
    "request_block_hashes",
]


def __getattr__(name: str) -> Any:
    if name == "RedisPrefixIndex":
        from pagedkv.router.redis_index import RedisPrefixIndex

        return RedisPrefixIndex
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
