"""Simulator layer: the report of an eviction-policy replay: hit rate per policy and capacity,
the offline optimum, and how much of LRU's gap to it the best online policy closes.

The report is a replay report (`mode: "replay"`) whose config names the policies; the shared
renderers of `pagedkv.sim.report` call `eviction_rows` for its table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.eviction import ONLINE_POLICY_NAMES
from pagedkv.sim.eviction_replay import PolicyPoint
from pagedkv.sim.inputs.traces import Trace


def gap_closed(lru: float, best_online: float, belady: float) -> float | None:
    """The share of the LRU-to-Belady gap the best online policy closes (None: no gap)."""
    if belady <= lru:
        return None
    return (best_online - lru) / (belady - lru)


def eviction_report(
    trace: Trace,
    points: Sequence[PolicyPoint],
    block_size: int,
    hash_algorithm: str,
    report_format: str,
) -> dict[str, Any]:
    """JSON-ready: one result per (policy, capacity), and a summary per capacity."""
    policies = list(dict.fromkeys(point.policy for point in points))
    capacities = sorted({point.capacity_blocks for point in points})
    host_capacity_blocks = points[0].host_capacity_blocks if points else 0
    results = [
        {
            "policy": point.policy,
            "capacity_blocks": point.capacity_blocks,
            "capacity_tokens": point.capacity_blocks * block_size,
            "hit_rate": _rate(point.hit_rate),
            "host_hit_rate": _rate(point.host_hit_rate),
            "num_hit_tokens": point.num_device_hit_tokens,
            "num_host_hit_tokens": point.num_host_hit_tokens,
            "num_prompt_tokens": point.num_prompt_tokens,
            "num_requests_not_fit": point.num_requests_not_fit,
        }
        for point in sorted(points, key=lambda p: (p.capacity_blocks, policies.index(p.policy)))
    ]
    return {
        "format": report_format,
        "mode": "replay",
        "trace": trace.summary(),
        "config": {
            "block_size": block_size,
            "hash_algorithm": hash_algorithm,
            "policies": policies,
            "host_capacity_blocks": host_capacity_blocks,
            "host_capacity_tokens": host_capacity_blocks * block_size,
        },
        "results": results,
        "summary": [_summary(capacity, block_size, points) for capacity in capacities],
    }


def _summary(capacity_blocks: int, block_size: int, points: Sequence[PolicyPoint]) -> dict:
    """Per capacity: LRU, the best online policy, Belady, and the share of the gap closed
    (device plus host hits, so a host tier counts)."""
    rates = {
        point.policy: point.hit_rate + point.host_hit_rate
        for point in points
        if point.capacity_blocks == capacity_blocks
    }
    online = {name: rate for name, rate in rates.items() if name in ONLINE_POLICY_NAMES}
    best_name = max(online, key=lambda name: (online[name], -ONLINE_POLICY_NAMES.index(name)))
    row: dict[str, Any] = {
        "capacity_blocks": capacity_blocks,
        "capacity_tokens": capacity_blocks * block_size,
        "best_online_policy": best_name if online else None,
        "best_online_hit_rate": _rate(online[best_name]) if online else None,
        "gap_closed": None,
    }
    if "lru" in rates and "belady" in rates and online:
        closed = gap_closed(rates["lru"], online[best_name], rates["belady"])
        row["gap_closed"] = None if closed is None else _rate(closed)
    return row


def _rate(value: float) -> float:
    return float(f"{value:.6g}")


def eviction_rows(report: dict[str, Any], notes: list[tuple[str, str]]) -> tuple[list, list]:
    """Table header and rows (one row per capacity, one column per policy), adding notes."""
    config = report["config"]
    policies = config["policies"]
    with_host = config["host_capacity_blocks"] > 0
    header = ["capacity (tokens)", *policies, "best online", "gap closed"]
    by_capacity: dict[int, dict[str, dict]] = {}
    for result in report["results"]:
        by_capacity.setdefault(result["capacity_blocks"], {})[result["policy"]] = result
    rows = []
    for summary in report["summary"]:
        cells = [f"{summary['capacity_tokens']:,}"]
        for policy in policies:
            result = by_capacity[summary["capacity_blocks"]][policy]
            cell = f"{100 * result['hit_rate']:.2f} %"
            if with_host:
                cell = f"{100 * result['hit_rate']:.2f} + {100 * result['host_hit_rate']:.2f} %"
            cells.append(cell)
        cells.append(summary["best_online_policy"] or "-")
        closed = summary["gap_closed"]
        cells.append("-" if closed is None else f"{100 * closed:.0f} %")
        rows.append(cells)
    notes.append(("block size", f"{config['block_size']} tokens ({config['hash_algorithm']})"))
    if with_host:
        notes.append(
            (
                "host tier",
                f"{config['host_capacity_tokens']:,} tokens; cells: device + host hit rate",
            )
        )
    notes.append(
        (
            "gap closed",
            "(best online - lru) / (belady - lru) of the token hit rate; belady is the "
            "offline optimum (it knows the trace's future)",
        )
    )
    return header, rows


def plot_eviction(report: dict[str, Any], path: str | Path) -> None:
    """Hit rate against capacity, one line per policy (belady dashed: the upper bound)."""
    from pagedkv.sim.report.plot import _pyplot, save_figure

    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for policy in report["config"]["policies"]:
        rows = [r for r in report["results"] if r["policy"] == policy]
        axes.plot(
            [r["capacity_tokens"] for r in rows],
            [100 * (r["hit_rate"] + r["host_hit_rate"]) for r in rows],
            marker="o",
            linestyle="--" if policy == "belady" else "-",
            label=policy,
        )
    if len(report["summary"]) > 1:
        axes.set_xscale("log")
    axes.set_xlabel("KV-cache capacity (tokens)")
    axes.set_ylabel("prefix-cache token hit rate (%)")
    axes.set_title(
        f"{report['trace']['name']}: eviction policies (block size "
        f"{report['config']['block_size']})"
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
