"""Simulator report layer, serve mode: a serve run's report (JSON-ready dict) and its table rows
and notes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.report.format import REPORT_FORMAT, groups_text, model_config, sparkline
from pagedkv.sim.serve import ServeConfig, ServeResult


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
        else model_config(model_name or "custom", kv_cache_config.kv_cache_groups)
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
    if config.eviction == "lru" and not config.host_num_blocks and not config.lookahead:
        return {}
    return {
        "eviction": config.eviction,
        "lookahead": config.lookahead,
        "host_num_blocks": config.host_num_blocks,
        "host_load_s_per_token": config.host_load_s_per_token,
    }


def serve_rows(
    report: dict[str, Any], notes: list[tuple[str, str]]
) -> tuple[list[str], list[list[str]]]:
    """The latency table of a serve report, its notes (setup, requests, throughput, cache,
    usage, timelines) appended to `notes`."""
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
            [label]
            + [
                _number(None if dist[q] is None else dist[q] * scale)
                for q in ("mean", "p50", "p90", "p99", "max")
            ]
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
        notes.append(("KV groups", groups_text(config["kv_cache_groups"])))
    if results.get("interrupted"):
        notes.append(
            (
                "INTERRUPTED",
                f"stopped (Ctrl-C, SIGTERM or SIGHUP) with "
                f"{results['num_requests_unfinished']:,} requests unfinished: every figure "
                "covers only what was measured until then",
            )
        )
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
                + (" with the waiting-queue look-ahead" if config.get("lookahead") else "")
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
    if served > 0 and offered > 1.2 * served and not results.get("interrupted"):
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
        notes.append((f"{label} over time", sparkline(values, unit)))
    return header, rows


def _number(value: float | None) -> str:
    if value is None:
        return "n/a"
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if value else "0"
