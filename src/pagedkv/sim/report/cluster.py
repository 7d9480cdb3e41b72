"""Simulator report layer, cluster mode: the report of N instances behind each router
(JSON-ready dict) and its plain-text table.

The config is serve mode's plus the cluster's settings; the results are one summary per router
(`pagedkv.sim.cluster.simulate_cluster`). Only simulated quantities, as every report.
"""

from __future__ import annotations

from typing import Any

from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.report.serve import serve_report
from pagedkv.sim.serve import ServeConfig, ServeResult


def cluster_report(
    trace: Trace,
    serve_config: ServeConfig,
    profile_name: str | None,
    summaries: list[dict[str, Any]],
    cluster_config: dict[str, Any],
) -> dict[str, Any]:
    """The report of a cluster run; `cluster_config` holds the cluster's settings (instances,
    event transport, load gap, index, router URL), written after serve mode's config."""
    base = serve_report(trace, serve_config, profile_name, ServeResult(summary={}))
    return {
        "format": base["format"],
        "mode": "cluster",
        "trace": base["trace"],
        "config": {**base["config"], **cluster_config},
        "results": summaries,
    }


def _seconds(value: float | None, width: int, digits: int) -> str:
    """A latency cell: `0.070s`, or `n/a` when no request finished."""
    return f"{'n/a':>{width + 1}}" if value is None else f"{value:>{width}.{digits}f}s"


def render_cluster_text(
    report: dict[str, Any], wall_s: float, num_prompt_tokens_simulated: int
) -> str:
    """The cluster report as plain text: one row per router, then the notes."""
    trace, config = report["trace"], report["config"]
    instances = f"{config['instances']} instance{'s' if config['instances'] != 1 else ''}"
    lines = [
        f"pagedkv simulate (cluster): {trace['name']}: {trace['num_requests']:,} requests, "
        f"{instances} x {config['num_blocks']:,} blocks, events over "
        f"{config['event_transport']} ZeroMQ",
        "",
        f"{'router':<14}{'completed':>10}{'hit rate':>10}{'TTFT p50':>11}{'TTFT p99':>11}"
        f"{'e2e p50':>10}{'req/s':>8}  {'requests per instance':<24}{'max/mean busy':>14}",
    ]
    for result in report["results"]:
        balance = result["load_balance"]
        per_instance = ",".join(str(n) for n in balance["requests_per_instance"])
        lines.append(
            f"{result['router']:<14}"
            f"{result['num_requests_completed']:>10,}"
            f"{100 * result['prefix_cache']['hit_rate']:>9.2f}%"
            f"{_seconds(result['ttft_s']['p50'], 10, 3)}"
            f"{_seconds(result['ttft_s']['p99'], 10, 3)}"
            f"{_seconds(result['e2e_latency_s']['p50'], 9, 2)}"
            f"{result['throughput']['requests_per_s']:>8.2f}  "
            f"{per_instance:<24}{balance['busy_time_max_over_mean']:>14.2f}"
        )
    matches = [r["routing"]["index_matches_pools"] for r in report["results"]]
    if None in matches:
        consistent = "unknown (the index is unavailable)"
    else:
        consistent = "yes" if all(matches) else "NO"
    lines.append("")
    for result in report["results"]:
        if result["num_requests_rejected"]:
            lines.append(
                f"{result['router']}: {result['num_requests_rejected']:,} requests rejected "
                f"(prompt >= max_model_len {config['max_model_len']:,})"
            )
        if result.get("interrupted"):
            lines.append(
                f"{result['router']}: INTERRUPTED (Ctrl-C, SIGTERM or SIGHUP) with "
                f"{result['num_requests_unfinished']:,} requests unfinished; its figures cover "
                "what was measured until then, and the routers after it did not run"
            )
    lines += [
        "hit rate: prefix-cache token hit rate over all instances; busy: simulated step time",
        f"router index equals every instance's cache at the end: {consistent}",
    ]
    if config.get("index", "memory") != "memory":
        lines.append(f"router index in {config['index']}")
    for result in report["results"]:
        routing = result["routing"]
        if routing.get("index_outages") or routing["fallback_decisions"]:
            lines.append(
                f"{result['router']}: index unavailable {routing['index_outages']} time(s), "
                f"{routing['index_recoveries']} recovered; {routing['fallback_decisions']} "
                f"routing decisions fell back to least-loaded"
            )
    rate = num_prompt_tokens_simulated / wall_s if wall_s > 0 else 0.0
    lines += [f"simulator speed: {wall_s:.1f} s wall, {rate:,.0f} simulated prompt tokens/s", ""]
    return "\n".join(lines)
