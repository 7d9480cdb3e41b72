"""Router layer: routing policies. Each picks one instance from loads and, for the
prefix-aware policy, the index's match lengths; none holds cluster state beyond a cursor."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from pagedkv.errors import InvalidArgumentError

POLICY_NAMES = ("round-robin", "least-loaded", "prefix-aware")


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
    """The instance caching the longest prefix of the request (ties: least load, then the
    first listed).

    `balance_abs_threshold`: when set and the most loaded instance carries more than this
    much load above the least loaded one, route by load instead, so one hot prefix cannot
    pile every request onto one instance (SGLang's router guards the same way).
    """

    name = "prefix-aware"
    uses_index = True

    def __init__(self, balance_abs_threshold: float | None = None) -> None:
        if balance_abs_threshold is not None and balance_abs_threshold < 0:
            raise InvalidArgumentError(
                f"balance_abs_threshold must be >= 0, got {balance_abs_threshold!r}"
            )
        self.balance_abs_threshold = balance_abs_threshold

    def choose(
        self,
        instance_ids: Sequence[str],
        loads: Mapping[str, float],
        match_lengths: Mapping[str, int] | None,
    ) -> str:
        threshold = self.balance_abs_threshold
        if match_lengths is None or (
            threshold is not None
            and max(loads.get(i, 0) for i in instance_ids)
            - min(loads.get(i, 0) for i in instance_ids)
            > threshold
        ):
            return min(instance_ids, key=lambda i: loads.get(i, 0))
        return min(instance_ids, key=lambda i: (-match_lengths.get(i, 0), loads.get(i, 0)))


def make_policy(name: str) -> RoutingPolicy:
    """Build a policy by its CLI name."""
    if name == "round-robin":
        return RoundRobinPolicy()
    if name == "least-loaded":
        return LeastLoadedPolicy()
    if name == "prefix-aware":
        return PrefixAwarePolicy()
    raise InvalidArgumentError(f"unknown routing policy {name!r}; choose one of {POLICY_NAMES}")
