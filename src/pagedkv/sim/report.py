"""Simulator layer: the report of a run, as a JSON-ready dict and as a terminal table.

The report holds only simulated quantities, so the same inputs give byte-identical JSON;
wall-clock speed travels separately (`Speed`) and is shown in the table only. `rich` is used
when installed (imported lazily), plain text otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pagedkv.sim.replay import ReplayPoint
from pagedkv.sim.serve import ServeConfig, ServeResult
from pagedkv.sim.traces import Trace
from pagedkv.specs import KVCacheGroupSpec

REPORT_FORMAT = "pagedkv.simulate/1"
_SPARK = "▁▂▃▄▅▆▇█"
_SPARK_ASCII = " .:-=+*#"


@dataclass(frozen=True, slots=True)
class Speed:
    """How fast the simulator ran (machine-dependent, so never part of the JSON)."""

    wall_s: float
    num_prompt_tokens_simulated: int

    @property
    def prompt_tokens_per_s(self) -> float:
        return self.num_prompt_tokens_simulated / self.wall_s if self.wall_s > 0 else 0.0


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


def _model_config(model_name: str, groups: Sequence[KVCacheGroupSpec]) -> dict[str, Any]:
    return {"model": model_name, "kv_cache_groups": kv_cache_groups_report(groups)}


def replay_report(
    trace: Trace,
    points: Sequence[ReplayPoint],
    block_size: int,
    hash_algorithm: str,
    model_name: str | None = None,
    kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
) -> dict[str, Any]:
    """With a model's `kv_cache_groups`, the config names the model and its groups, and
    `capacity_tokens` is null: a block count shared by several groups is no token count."""
    config: dict[str, Any] = {"block_size": block_size, "hash_algorithm": hash_algorithm}
    if kv_cache_groups is not None:
        config.update(_model_config(model_name or "custom", kv_cache_groups))
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


def serve_report(
    trace: Trace,
    config: ServeConfig,
    profile_name: str | None,
    result: ServeResult,
    model_name: str | None = None,
) -> dict[str, Any]:
    """With `config.kv_cache_config` set, the config names the model and its groups, and
    `capacity_tokens` is null: a block count shared by several groups is no token count."""
    scheduler = asdict(config.scheduler)
    scheduler["stop_token_ids"] = list(scheduler["stop_token_ids"])
    duration_s = trace.duration_s * config.time_scale
    offered = trace.num_prompt_tokens / duration_s if duration_s > 0 else 0.0
    kv_cache_config = config.kv_cache_config
    model = (
        {}
        if kv_cache_config is None
        else _model_config(model_name or "custom", kv_cache_config.kv_cache_groups)
    )
    return {
        "format": REPORT_FORMAT,
        "mode": "serve",
        "trace": trace.summary(),
        "config": {
            "profile": profile_name,
            **model,
            "cost_model": asdict(config.cost_model),
            "block_size": config.block_size,
            "num_blocks": config.num_blocks,
            "capacity_tokens": (
                None if kv_cache_config is not None else config.num_blocks * config.block_size
            ),
            "max_model_len": config.max_model_len,
            "policy": config.policy,
            "time_scale": config.time_scale,
            "enable_prefix_caching": config.enable_prefix_caching,
            "watermark": config.watermark,
            "hash_algorithm": config.hash_algorithm,
            "scheduler": scheduler,
            **_eviction_config(config),
        },
        "offered_prompt_tokens_per_s": float(f"{offered:.6g}"),
        "results": result.summary,
    }


def _eviction_config(config: ServeConfig) -> dict[str, Any]:
    """The eviction settings, only when not the default (older reports stay byte-identical)."""
    if config.eviction == "lru" and not config.host_num_blocks:
        return {}
    return {
        "eviction": config.eviction,
        "host_num_blocks": config.host_num_blocks,
        "host_load_s_per_token": config.host_load_s_per_token,
    }


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=2) + "\n"


# ----------------------------------------------------------------------------- rendering


def _rows(
    report: dict[str, Any], speed: Speed | None
) -> tuple[str, list[str], list[list[str]], list[tuple[str, str]]]:
    """Title, table header, table rows and (label, value) notes for either mode."""
    trace = report["trace"]
    title = (
        f"pagedkv simulate ({report['mode']}): {trace['name']}: {trace['num_requests']:,} "
        f"requests, {trace['num_prompt_tokens']:,} prompt tokens over {trace['duration_s']:,.0f} s"
    )
    notes: list[tuple[str, str]] = []
    if report["mode"] == "replay" and "policies" in report["config"]:
        from pagedkv.sim.eviction_report import eviction_rows

        header, rows = eviction_rows(report, notes)
    elif report["mode"] == "replay":
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
            notes.append(("KV groups", _groups_text(config["kv_cache_groups"])))
        else:
            notes.append(
                ("block size", f"{config['block_size']} tokens ({config['hash_algorithm']})")
            )
    else:
        header, rows = _serve_rows(report, notes)
    if speed is not None:
        notes.append(
            (
                "simulator speed",
                f"{speed.wall_s:.1f} s wall, {speed.prompt_tokens_per_s:,.0f} simulated prompt "
                "tokens/s",
            )
        )
    return title, header, rows, notes


def _serve_rows(
    report: dict[str, Any], notes: list[tuple[str, str]]
) -> tuple[list[str], list[list[str]]]:
    config = report["config"]
    results = report["results"]
    header = ["latency", "mean", "p50", "p90", "p99", "max"]
    rows = []
    for label, key, scale in (
        ("TTFT (s)", "ttft_s", 1.0),
        ("TPOT (ms)", "tpot_s", 1000.0),
        ("end to end (s)", "e2e_latency_s", 1.0),
    ):
        dist = results[key]
        rows.append(
            [label] + [_number(dist[q] * scale) for q in ("mean", "p50", "p90", "p99", "max")]
        )
    throughput = results["throughput"]
    cache = results["prefix_cache"]
    scheduler = config["scheduler"]
    if "model" in config:
        setup = (
            f"KV layout from {config['model']}, cost model {config['profile'] or 'custom'}; "
            f"{config['num_blocks']:,} blocks shared by {len(config['kv_cache_groups'])} "
            f"group{'s' if len(config['kv_cache_groups']) != 1 else ''}"
        )
    else:
        setup = (
            f"{config['profile'] or 'custom cost model'}; {config['num_blocks']:,} blocks x "
            f"{config['block_size']} tokens = {config['capacity_tokens']:,} KV tokens"
        )
    notes.append(
        (
            "setup",
            f"{setup}; {config['policy']}; batch {scheduler['max_num_batched_tokens']:,} "
            f"tokens / {scheduler['max_num_seqs']} seqs; time scale {config['time_scale']:g}",
        )
    )
    if "model" in config:
        notes.append(("KV groups", _groups_text(config["kv_cache_groups"])))
    notes.extend(
        [
            (
                "requests",
                f"{results['num_requests_completed']:,} completed, "
                f"{results['num_requests_rejected']:,} rejected (prompt >= max_model_len "
                f"{config['max_model_len']:,}); {results['num_steps']:,} steps over "
                f"{results['simulated_time_s']:,.1f} simulated s",
            ),
            (
                "throughput",
                f"{throughput['requests_per_s']:.2f} req/s, "
                f"{throughput['prompt_tokens_per_s']:,.0f} prompt tok/s "
                f"(offered {report['offered_prompt_tokens_per_s']:,.0f}), "
                f"{throughput['output_tokens_per_s']:,.0f} output tok/s",
            ),
            (
                "prefix cache",
                f"hit rate {100 * cache['hit_rate']:.2f} % ({cache['hits']:,} of "
                f"{cache['queries']:,} prompt tokens); re-admissions after preemption hit "
                f"{cache['preempted_hits']:,} of {cache['preempted_queries']:,}",
            ),
            (
                "preemptions",
                f"{results['preemptions']['num_preemptions']:,} "
                f"({results['preemptions']['num_requests_preempted']:,} requests)",
            ),
            (
                "KV usage",
                f"peak {100 * results['usage']['peak']:.1f} %, "
                f"mean {100 * results['usage']['mean']:.1f} %",
            ),
            (
                "running / waiting",
                f"peak {results['num_running']['peak']:,} / {results['num_waiting']['peak']:,}, "
                f"mean {results['num_running']['mean']:,.1f} / "
                f"{results['num_waiting']['mean']:,.1f}",
            ),
        ]
    )
    if "eviction" in config:
        host = results.get("host_tier")
        notes.append(
            (
                "eviction",
                f"{config['eviction']}"
                + (
                    f"; host tier {config['host_num_blocks']:,} blocks: {host['num_loads']:,} "
                    f"loads, {host['loaded_tokens']:,} tokens "
                    f"({100 * host['loaded_token_rate']:.2f} % of prompt tokens)"
                    if host
                    else ""
                ),
            )
        )
    served = throughput["prompt_tokens_per_s"]
    offered = report["offered_prompt_tokens_per_s"]
    if served > 0 and offered > 1.2 * served:
        notes.append(
            (
                "load",
                f"overloaded: prompts arrive {offered / served:.1f}x faster than they are served, "
                "so queues grow; --time-scale slows arrivals",
            )
        )
    timeline = results["timeline"]
    for label, key, unit in (
        ("usage", "usage", "%"),
        ("running", "num_running", ""),
        ("waiting", "num_waiting", ""),
    ):
        values = timeline[key]
        if unit == "%":
            values = [100 * value for value in values]
        notes.append((f"{label} over time", _sparkline(values, unit)))
    return header, rows


def _capacity_tokens_cell(row: dict[str, Any]) -> str:
    if row["capacity_blocks"] is None:
        return "unlimited"
    return "-" if row["capacity_tokens"] is None else f"{row['capacity_tokens']:,}"


def _groups_text(groups: list[dict[str, Any]]) -> str:
    """`5 x sliding_window(1024)/16, full_attention/16 (kind/block size)`."""
    counts: dict[str, int] = {}
    for group in groups:
        extra = group.get("sliding_window") or group.get("attention_chunk_size")
        label = f"{group['kind']}{f'({extra})' if extra else ''}/{group['block_size']}"
        counts[label] = counts.get(label, 0) + 1
    parts = [f"{count} x {label}" if count > 1 else label for label, count in counts.items()]
    return f"{', '.join(parts)} (kind/block size)"


def _number(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if value else "0"


def _sparkline(values: Sequence[float], unit: str = "", width: int = 40) -> str:
    """One character per time bucket (the bucket's maximum), scaled to the overall maximum."""
    ramp = _SPARK
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


def render_text(
    report: dict[str, Any], speed: Speed | None = None, ascii_only: bool = False
) -> str:
    """The report as plain text."""
    title, header, rows, notes = _rows(report, speed)
    if ascii_only:
        notes = [
            (label, value.translate(str.maketrans(_SPARK, _SPARK_ASCII))) for label, value in notes
        ]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [title, ""]
    lines.append("  ".join(cell.rjust(width) for cell, width in zip(header, widths, strict=True)))
    lines.append("  ".join("-" * width for width in widths))
    for row in rows:
        lines.append("  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True)))
    lines.append("")
    label_width = max((len(label) for label, _ in notes), default=0)
    for label, value in notes:
        lines.append(f"{label.ljust(label_width)}  {value}")
    return "\n".join(lines) + "\n"


def render_rich(report: dict[str, Any], speed: Speed | None, console: Any) -> None:
    """Print the report with rich (a `rich.console.Console`)."""
    from rich.table import Table

    title, header, rows, notes = _rows(report, speed)
    console.print(title, style="bold", highlight=False)
    table = Table()
    for index, name in enumerate(header):
        table.add_column(
            name, justify="left" if index == 0 and report["mode"] == "serve" else "right"
        )
    for row in rows:
        table.add_row(*row)
    console.print(table)
    details = Table(show_header=False, box=None, pad_edge=False)
    details.add_column(style="bold")
    details.add_column()
    for label, value in notes:
        details.add_row(label, value)
    console.print(details)
