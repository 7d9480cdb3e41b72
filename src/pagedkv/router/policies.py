"""Router layer: routing policies. Each picks one instance from loads and, for the
prefix-aware policy, the index's match lengths; none holds cluster state beyond a cursor."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from pagedkv.errors import InvalidArgumentError

ROUTING_POLICY_NAMES = ("round-robin", "least-loaded", "prefix-aware")
"""Every routing policy, by name (eviction policies: `pagedkv.eviction.EVICTION_POLICY_NAMES`)."""
POLICY_NAMES = ROUTING_POLICY_NAMES
"""The old name of `ROUTING_POLICY_NAMES`, kept for callers."""


class RoutingPolicy(Protocol):
    name: str
    uses_index: bool
    """Whether `choose` needs match lengths (and so a reachable index)."""

    def choose(
        self,
        instance_ids: Sequence[str],
        loads: Mapping[str, float],
        match_lengths: Mapping[str, int] | None,
    ) -> str: ...


class RoundRobinPolicy:
    """Instances in turn, ignoring load and cache."""

    name = "round-robin"
    uses_index = False

    def __init__(self) -> None:
        self._cursor = 0

    def choose(
        self,
        instance_ids: Sequence[str],
        loads: Mapping[str, float],
        match_lengths: Mapping[str, int] | None,
    ) -> str:
        chosen = instance_ids[self._cursor % len(instance_ids)]
        self._cursor += 1
        return chosen


class LeastLoadedPolicy:
    """The instance with the least load (ties: the first listed)."""

    name = "least-loaded"
    uses_index = False

    def choose(
        self,
        instance_ids: Sequence[str],
        loads: Mapping[str, float],
        match_lengths: Mapping[str, int] | None,
    ) -> str:
        return min(instance_ids, key=lambda i: loads.get(i, 0))


class PrefixAwarePolicy:
    """The instance caching the longest prefix of the request (ties: least load, then one at
    random from a generator seeded with `seed`, so equal instances share the traffic and a
    run is reproducible; `seed=None`: the first listed, as the simulator's runs keep).

    `max_load_gap`: when set, only instances within this much load of the least loaded one
    are candidates, so a prefix every request shares (a system prompt) cannot pile the whole
    workload onto the instance that cached it first. None: pure prefix scoring.
    """

    name = "prefix-aware"
    uses_index = True

    def __init__(self, max_load_gap: float | None = None, seed: int | None = 0) -> None:
        if max_load_gap is not None and not max_load_gap >= 0:
            raise InvalidArgumentError(f"max_load_gap must be >= 0, got {max_load_gap!r}")
        self.max_load_gap = max_load_gap
        self._rng = None if seed is None else random.Random(seed)

    def choose(
        self,
        instance_ids: Sequence[str],
        loads: Mapping[str, float],
        match_lengths: Mapping[str, int] | None,
    ) -> str:
        if match_lengths is None:
            return min(instance_ids, key=lambda i: loads.get(i, 0))
        candidates = instance_ids
        if self.max_load_gap is not None:
            limit = min(loads.get(i, 0) for i in instance_ids) + self.max_load_gap
            candidates = [i for i in instance_ids if loads.get(i, 0) <= limit]
        best_key = min((-match_lengths.get(i, 0), loads.get(i, 0)) for i in candidates)
        best = [i for i in candidates if (-match_lengths.get(i, 0), loads.get(i, 0)) == best_key]
        return best[0] if len(best) == 1 or self._rng is None else self._rng.choice(best)


def make_policy(
    name: str, max_load_gap: float | None = None, seed: int | None = None
) -> RoutingPolicy:
    """Build a policy by its CLI name (`max_load_gap` and `seed` apply to prefix-aware only;
    `seed=None`: ties go to the first listed)."""
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy()
    if name == "prefix-aware":
        return PrefixAwarePolicy(max_load_gap, seed)
    raise InvalidArgumentError(
        f"unknown routing policy {name!r}; choose one of {ROUTING_POLICY_NAMES}"
    )
