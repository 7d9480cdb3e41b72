"""Eviction: which cached free block a pool reuses next, chosen once, at construction.

`lru` (the default) is the pool's own free queue, bit-for-bit the reference's; `lfu`, `s3fifo`,
`arc` and `cost` are online policies on a block's own history (`pagedkv.eviction.<name>`);
`continuation` and `hazard` also use what a serving system knows of the request that freed the
blocks (its session, `eviction.sessions`); `belady` is the offline optimum, for replay.
Retention hints, the waiting-queue look-ahead and a host-memory tier work with every policy.
The factory lives here, above the policies and the free queue it picks between.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

from pagedkv.block import KVCacheBlock
from pagedkv.errors import ConfigError
from pagedkv.eviction.arc import ARCPolicy
from pagedkv.eviction.base import EvictionPolicy
from pagedkv.eviction.belady import NEVER, BeladyPolicy, FutureOracle
from pagedkv.eviction.continuation import ContinuationPolicy
from pagedkv.eviction.cost import DEFAULT_ATTENTION_CROSSOVER_TOKENS, CostPolicy
from pagedkv.eviction.host_tier import HostTier
from pagedkv.eviction.lfu import LFUPolicy
from pagedkv.eviction.lookahead import WaitingLookahead
from pagedkv.eviction.lru import LRUPolicy
from pagedkv.eviction.retention_levels import RetentionLevels
from pagedkv.eviction.s3fifo import S3FIFOPolicy
from pagedkv.eviction.sessions import SessionStats
from pagedkv.eviction.time_aware import HazardPolicy
from pagedkv.free_queue import FreeKVCacheBlockQueue

EVICTION_POLICY_NAMES = (
    "lru",
    "lfu",
    "s3fifo",
    "arc",
    "cost",
    "continuation",
    "hazard",
    "belady",
)
"""Every eviction policy, by name (routing policies: `pagedkv.router.ROUTING_POLICY_NAMES`)."""
ONLINE_POLICY_NAMES = EVICTION_POLICY_NAMES[:-1]
"""The policies a serving engine can run (belady needs the future)."""
SESSION_POLICY_NAMES = ("continuation", "hazard")
"""The policies that learn from requests' sessions (the manager's `add_waiting` and `free`)."""
POLICY_NAMES = EVICTION_POLICY_NAMES
"""The old name of `EVICTION_POLICY_NAMES`, kept for callers."""


class FreeBlockSet(Protocol):
    """What the pool needs of its free blocks: `FreeKVCacheBlockQueue` or an `EvictionPolicy`."""

    num_free_blocks: int

    def popleft(self) -> KVCacheBlock: ...
    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]: ...
    def remove(self, block: KVCacheBlock) -> None: ...
    def append(self, block: KVCacheBlock) -> None: ...
    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None: ...
    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None: ...
    def __iter__(self) -> Iterator[KVCacheBlock]: ...
    def __len__(self) -> int: ...
    def get_all_free_blocks(self) -> list[KVCacheBlock]: ...
    def check_invariants(self) -> None: ...


@dataclass(frozen=True)
class EvictionConfig:
    """How a pool evicts: the policy and the optional retention and host-tier features.

    `retention`: honour requests' `RetentionConfig` hints; at most `max_retained_fraction` of
    the usable blocks may hold a raised priority at once (beyond, hints are demoted to the
    default). `lookahead`: evict last the free blocks that requests in the waiting queue will
    hit (the scheduler calls the manager's `add_waiting`). `host_num_blocks`: capacity of the
    host-memory tier in blocks (0: none; one KV-cache group only). `oracle`: the future, for
    `belady` only. `clock`: seconds, for retention durations and the `hazard` policy's gaps
    (the simulator passes its simulated clock).
    """

    policy: str = "lru"
    retention: bool = False
    lookahead: bool = False
    max_retained_fraction: float = 0.5
    host_num_blocks: int = 0
    oracle: FutureOracle | None = None
    clock: Callable[[], float] = time.monotonic
    attention_crossover_tokens: int = DEFAULT_ATTENTION_CROSSOVER_TOKENS

    def __post_init__(self) -> None:
        if self.policy not in EVICTION_POLICY_NAMES:
            raise ConfigError(
                f"unknown eviction policy {self.policy!r}; "
                f"choose one of {list(EVICTION_POLICY_NAMES)}"
            )
        if (self.policy == "belady") != (self.oracle is not None):
            raise ConfigError(
                "eviction policy 'belady' needs an oracle (the future: replay only), and only "
                f"belady takes one (policy {self.policy!r}, oracle {self.oracle!r})"
            )
        fraction = self.max_retained_fraction
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0)
        ):
            raise ConfigError(f"max_retained_fraction={fraction!r} must be in [0, 1]")
        if type(self.host_num_blocks) is not int or self.host_num_blocks < 0:
            raise ConfigError(f"host_num_blocks={self.host_num_blocks!r} must be an int >= 0")
        if type(self.lookahead) is not bool:
            raise ConfigError(f"lookahead={self.lookahead!r} must be True or False")
        if type(self.retention) is not bool:
            raise ConfigError(f"retention={self.retention!r} must be True or False")
        if not callable(self.clock):
            raise ConfigError(f"clock={self.clock!r} must be a callable returning seconds")

    @property
    def is_plain_lru(self) -> bool:
        """The reference's free queue alone: no policy object, no hooks."""
        return self.policy == "lru" and not self.retention and not self.lookahead


DEFAULT_EVICTION = EvictionConfig()


@dataclass(frozen=True, slots=True)
class EvictionStats:
    """A pool's eviction state. Counters count since construction; `num_*_blocks` are now.

    `num_retained_blocks`: cached blocks holding a raised retention priority;
    `num_retention_demotions`: raises refused by the cap (the block kept the default);
    `num_retention_lapses`: priorities returned to the default when their duration ran out;
    `num_host_blocks`: entries in the host tier; `num_host_demotions`, `num_host_evictions`:
    stored to and dropped from it; `num_host_loads`: blocks loaded back from it (host hits);
    `num_protected_blocks`: free blocks the look-ahead holds back for waiting requests now;
    `num_lookahead_protections`: blocks it took out of the policy's order since construction.
    """

    policy: str
    num_retained_blocks: int = 0
    num_retention_demotions: int = 0
    num_retention_lapses: int = 0
    num_host_blocks: int = 0
    num_host_demotions: int = 0
    num_host_evictions: int = 0
    num_host_loads: int = 0
    num_protected_blocks: int = 0
    num_lookahead_protections: int = 0


def as_eviction_config(value: EvictionConfig | str | None) -> EvictionConfig:
    """Accept a config, a policy name, or None (the default, plain LRU)."""
    if value is None:
        return DEFAULT_EVICTION
    if isinstance(value, EvictionConfig):
        return value
    if isinstance(value, str):
        return EvictionConfig(policy=value)
    raise ConfigError(f"eviction must be an EvictionConfig or a policy name, got {value!r}")


def make_free_blocks(config: EvictionConfig, blocks: list[KVCacheBlock]) -> FreeBlockSet:
    """The free-block set of a new pool: the plain queue for LRU, else the policy object."""
    if config.is_plain_lru:
        return FreeKVCacheBlockQueue(blocks)
    retention = None
    if config.retention:
        max_retained = int(config.max_retained_fraction * max(len(blocks) - 1, 0))
        retention = RetentionLevels(blocks, max_retained, config.clock)
    policy = _make_policy(config, blocks, retention)
    if config.lookahead:
        policy.enable_lookahead(WaitingLookahead(blocks))
    return policy


def _make_policy(
    config: EvictionConfig, blocks: list[KVCacheBlock], retention: RetentionLevels | None
) -> EvictionPolicy:
    name = config.policy
    if name == "lru":
        return LRUPolicy(blocks, retention)
    if name == "lfu":
        return LFUPolicy(blocks, retention)
    if name == "s3fifo":
        return S3FIFOPolicy(blocks, retention)
    if name == "arc":
        return ARCPolicy(blocks, retention)
    if name == "cost":
        return CostPolicy(blocks, retention, config.attention_crossover_tokens)
    if name == "continuation":
        return ContinuationPolicy(blocks, retention, config.clock)
    if name == "hazard":
        return HazardPolicy(blocks, retention, config.clock)
    assert name == "belady"
    return BeladyPolicy(blocks, retention, config.oracle)


__all__ = [
    "DEFAULT_EVICTION",
    "EVICTION_POLICY_NAMES",
    "NEVER",
    "ONLINE_POLICY_NAMES",
    "POLICY_NAMES",
    "SESSION_POLICY_NAMES",
    "ARCPolicy",
    "BeladyPolicy",
    "ContinuationPolicy",
    "CostPolicy",
    "EvictionConfig",
    "EvictionPolicy",
    "EvictionStats",
    "FreeBlockSet",
    "FutureOracle",
    "HazardPolicy",
    "HostTier",
    "LFUPolicy",
    "LRUPolicy",
    "RetentionLevels",
    "S3FIFOPolicy",
    "SessionStats",
    "WaitingLookahead",
    "as_eviction_config",
    "make_free_blocks",
]
