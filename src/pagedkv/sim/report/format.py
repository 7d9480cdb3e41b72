"""Simulator report layer, the shared format: the version tag and JSON text of every report,
the simulator's speed (machine-dependent, so never in the JSON), and the sections and cells
several modes' reports share (KV-cache groups, sparklines).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.specs import KVCacheGroupSpec

REPORT_FORMAT = "pagedkv.simulate/1"
SPARK_RAMP = "▁▂▃▄▅▆▇█"
SPARK_RAMP_ASCII = " .:-=+*#"  # the same levels for a terminal without Unicode


@dataclass(frozen=True, slots=True)
class Speed:
    """How fast the simulator ran (machine-dependent, so never part of the JSON)."""

    wall_s: float
    num_prompt_tokens_simulated: int
    num_steps: int = 0  # scheduler steps (serve mode), 0 where a mode has none

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.num_prompt_tokens_simulated / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def steps_per_s(self) -> float:
        return self.num_steps / self.wall_s if self.wall_s > 0 else 0.0


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2) + "\n"


def kv_cache_groups_report(groups: Sequence[KVCacheGroupSpec]) -> list[dict[str, Any]]:
    """Kind, block size, layer count and window or chunk of each group, in group order."""
    rows = []
    for group in groups:
        spec = group.kv_cache_spec
        row: dict[str, Any] = {
            "kind": spec.kind,
            "block_size": spec.block_size,
            "num_layers": len(group.layer_names),
        }
        for name in ("sliding_window", "attention_chunk_size"):
            if getattr(spec, name, None) is not None:
                row[name] = getattr(spec, name)
        rows.append(row)
    return rows


def model_config(model_name: str, groups: Sequence[KVCacheGroupSpec]) -> dict[str, Any]:
    return {"model": model_name, "kv_cache_groups": kv_cache_groups_report(groups)}


def groups_text(groups: list[dict[str, Any]]) -> str:
    """`5 x sliding_window(1024)/16, full_attention/16 (kind/block size)`."""
    counts: dict[str, int] = {}
    for group in groups:
        extra = group.get("sliding_window") or group.get("attention_chunk_size")
        label = f"{group['kind']}{f'({extra})' if extra else ''}/{group['block_size']}"
        counts[label] = counts.get(label, 0) + 1
    parts = [f"{count} x {label}" if count > 1 else label for label, count in counts.items()]
    return f"{', '.join(parts)} (kind/block size)"


def sparkline(values: Sequence[float], unit: str = "", width: int = 40) -> str:
    """One character per time bucket (the bucket's maximum), scaled to the overall maximum."""
    ramp = SPARK_RAMP
    if not values:
        return ""
    if len(values) > width:
        buckets = []
        for index in range(width):
            low = len(values) * index // width
            high = max(len(values) * (index + 1) // width, low + 1)
            buckets.append(max(values[low:high]))
        values = buckets
    top = max(values)
    if top <= 0:
        return ramp[0] * len(values)
    scale = (len(ramp) - 1) / top
    line = "".join(ramp[round(value * scale)] for value in values)
    return f"{line} max {top:,.0f}{unit}"
