"""Simulator cluster: N serving instances behind a router fed by their KV events over ZeroMQ
(`pagedkv simulate --instances N`), the audit of its routing, and the remote router.

`run` holds the simulation; `audit` checks each routing decision against the truth;
`remote_router` routes through a running `pagedkv router serve`. Above serve mode.
"""

from pagedkv.sim.cluster.run import EVENT_TRANSPORTS, ClusterConfig, simulate_cluster

__all__ = ["EVENT_TRANSPORTS", "ClusterConfig", "simulate_cluster"]
