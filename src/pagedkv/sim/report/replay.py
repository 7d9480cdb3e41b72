"""Simulator report layer, replay mode: the capacity study's report (JSON-ready dict) and its
table rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.replay import ReplayPoint
from pagedkv.sim.report.format import REPORT_FORMAT, groups_text, model_config
from pagedkv.specs import KVCacheGroupSpec


def replay_report(
    trace: Trace,
    points: Sequence[ReplayPoint],
    block_size: int,
    hash_algorithm: str,
    model_name: str | None = None,
    kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
) -> dict[str, Any]:
    """Results sorted by capacity, unlimited last. With a model's `kv_cache_groups`, the
    config names the model and its groups, and `capacity_tokens` is null: a block count
    shared by several groups is no token count."""
    config: dict[str, Any] = {"block_size": block_size, "hash_algorithm": hash_algorithm}
    points = sorted(points, key=_capacity_order)
    if kv_cache_groups is not None:
        config.update(model_config(model_name or "custom", kv_cache_groups))
    return {
        "format": REPORT_FORMAT,
        "mode": "replay",
        "trace": trace.summary(),
        "config": config,
        "results": [
            {
                "capacity_blocks": point.capacity_blocks,
                "capacity_tokens": (
                    None
                    if point.capacity_blocks is None or kv_cache_groups is not None
                    else point.capacity_blocks * block_size
                ),
                "hit_rate": float(f"{point.hit_rate:.6g}"),
                "num_hit_tokens": point.num_hit_tokens,
                "num_prompt_tokens": point.num_prompt_tokens,
                "num_requests_not_fit": point.num_requests_not_fit,
            }
            for point in points
        ],
    }


def _capacity_order(point: ReplayPoint) -> tuple[bool, int]:
    capacity = point.capacity_blocks
    return (capacity is None, capacity or 0)


def replay_rows(
    report: dict[str, Any], notes: list[tuple[str, str]]
) -> tuple[list[str], list[list[str]]]:
    """The table of a replay report (one row per capacity), its notes appended to `notes`."""
    header = ["capacity (blocks)", "capacity (tokens)", "hit rate", "hit tokens", "not fit"]
    rows = [
        [
            "unlimited" if r["capacity_blocks"] is None else f"{r['capacity_blocks']:,}",
            _capacity_tokens_cell(r),
            f"{100 * r['hit_rate']:.2f} %",
            f"{r['num_hit_tokens']:,}",
            f"{r['num_requests_not_fit']:,}",
        ]
        for r in report["results"]
    ]
    config = report["config"]
    if "model" in config:
        notes.append(("KV layout", f"from {config['model']} ({config['hash_algorithm']})"))
        notes.append(("KV groups", groups_text(config["kv_cache_groups"])))
    else:
        notes.append(("block size", f"{config['block_size']} tokens ({config['hash_algorithm']})"))
    return header, rows


def _capacity_tokens_cell(row: dict[str, Any]) -> str:
    if row["capacity_blocks"] is None:
        return "unlimited"
    return "-" if row["capacity_tokens"] is None else f"{row['capacity_tokens']:,}"
