"""Simulator layer: the cluster simulation routed by a running `pagedkv router serve`
(`simulate --instances N --router-url http://...`) instead of the in-process router.

The simulated instances publish on the endpoints the service subscribes to (read from its
/health), and every decision waits, through the request's `sync`, until the service applied
every batch published so far, so runs stay deterministic, as in process.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.router import IndexUnavailableError, RoutingDecision
from pagedkv.router.client import DEFAULT_TIMEOUT_S, RouterClient

_FRESH_TIMEOUT_S = 20.0

# What this module reads of the service's /health, and the instance entries' fields.
_HEALTH_FIELDS: dict[str, type] = {
    "instances": dict, "block_size": int, "hash_algorithm": str, "index_available": bool,
    "index_exact": bool, "outages": int, "recoveries": int, "policy": str,
}  # fmt: skip
_INSTANCE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "endpoint": str,
    "replay_endpoint": (str, type(None)),
    "connected": bool,
}


def check_health(url: str, health: Any) -> dict[str, Any]:
    """`health` if it is the /health answer of `pagedkv router serve`, else a `ConfigError`
    naming the first field that is missing or of the wrong type (another JSON service)."""

    def refuse(what: str) -> ConfigError:
        return ConfigError(f"--router-url {url} is not `pagedkv router serve`: its /health {what}")

    if not isinstance(health, dict):
        raise refuse(f"is {type(health).__name__}, not an object")
    for name, kind in _HEALTH_FIELDS.items():
        if name not in health:
            raise refuse(f"has no {name!r}")
        if not isinstance(health[name], kind) or (kind is int and isinstance(health[name], bool)):
            raise refuse(f"has {name!r} = {health[name]!r}, not {kind.__name__}")
    for instance_id, entry in health["instances"].items():
        if not isinstance(entry, dict):
            raise refuse(f"has instance {instance_id!r} = {entry!r}, not an object")
        for name, kinds in _INSTANCE_FIELDS.items():
            if name not in entry or not isinstance(entry[name], kinds):
                raise refuse(f"has instance {instance_id!r} without a valid {name!r}")
    return health


class RemoteRouter:
    """Routes through the service; offers the counters the cluster summary reads.

    Instance i of the simulation is the service's i-th instance (in its configured order).
    """

    def __init__(
        self, url: str, num_instances: int, block_size: int, hash_algorithm: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):  # fmt: skip
        self.client = RouterClient(url, timeout_s)
        try:
            health = check_health(url, self.client.health())
        except IndexUnavailableError as exc:
            raise ConfigError(f"--router-url {url}: no router answers ({exc})") from exc
        self.service_ids = list(health["instances"])
        if len(self.service_ids) != num_instances:
            raise ConfigError(
                f"--router-url {url} routes {len(self.service_ids)} instances, the simulation "
                f"has {num_instances} (--instances)"
            )
        if (health["block_size"], health["hash_algorithm"]) != (block_size, hash_algorithm):
            raise ConfigError(
                f"--router-url {url} hashes with {health['hash_algorithm']} at block size "
                f"{health['block_size']}; the simulation uses {hash_algorithm} at {block_size}"
            )
        self.endpoints = [
            (health["instances"][i]["endpoint"], health["instances"][i]["replay_endpoint"])
            for i in self.service_ids
        ]
        self.url = url
        self._health = health
        self.num_fallback_decisions = 0
        self.num_dropped_event_batches = 0

    def wait_for_fresh_streams(self) -> None:
        """Wait until the service is connected to this run's (empty) publishers: it may still
        hold a previous run's streams, whose sequence numbers would satisfy `sync`."""
        deadline = time.monotonic() + _FRESH_TIMEOUT_S
        while True:
            health = self.client.health()
            states = [health["instances"][i] for i in self.service_ids]
            if all(s["connected"] and s["last_seq"] in (None, -1) for s in states):
                return
            if time.monotonic() > deadline:
                raise ConfigError(f"{self.url}: not connected to the simulated instances: {states}")
            time.sleep(0.05)

    def route_request(
        self, token_ids: Sequence[int], loads: Mapping[str, float], published: Sequence[int],
        policy: str,
    ) -> RoutingDecision:  # fmt: skip
        """Route one request; `loads` and `published` (last seq per instance) by sim index."""
        ids = self.service_ids
        sync = {ids[n]: seq for n, seq in enumerate(published) if seq >= 0}
        answer = self.client.route(
            token_ids, {ids[int(i)]: load for i, load in loads.items()}, policy=policy, sync=sync
        )
        self.num_fallback_decisions += answer["fallback"]
        chosen = str(ids.index(answer["instance"]))
        scores = {str(n): answer["scores"][i]["blocks"] for n, i in enumerate(ids)}
        return RoutingDecision(
            chosen, answer["policy"], answer["matched_blocks"], answer["fallback"],
            None if answer["fallback"] else scores,
        )  # fmt: skip

    def maybe_recover(self, force: bool = False) -> None:
        self._health = self.client.health()

    @property
    def degraded(self) -> bool:
        return not self._health["index_available"]

    @property
    def exact(self) -> bool:
        return bool(self._health["index_exact"])

    @property
    def num_outages(self) -> int:
        return int(self._health["outages"])

    @property
    def num_recoveries(self) -> int:
        return int(self._health["recoveries"])

    def close(self) -> None:
        self.client.close()

    def describe(self) -> dict[str, Any]:
        return {"router_url": self.url, "service_policy": self._health["policy"]}
