"""Simulator layer: PNG plots of a report (needs matplotlib, imported lazily).

Replay: hit rate against capacity. Serve: KV usage, running and waiting requests over time.
Memory study: hit rate and TTFT against KV memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.atomic_file import atomic_write
from pagedkv.errors import MissingDependencyError, install_hint
from pagedkv.sim.serve import ServeResult


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as exc:
        raise MissingDependencyError(f"--plot needs matplotlib: {install_hint('sim')}") from exc
    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure: Any, path: str | Path) -> None:
    """Write `figure` to `path`, in the format its extension names, whole or not at all: two
    runs writing one path leave one run's plot, never a mix (`pagedkv.atomic_file`)."""
    suffix = Path(path).suffix.lower().removeprefix(".")
    with atomic_write(path) as file:
        figure.savefig(file, format=suffix or None, dpi=120)


def plot_replay(report: dict[str, Any], path: str | Path) -> None:
    """Token hit rate against capacity (log scale); the unlimited point as a dashed line."""
    plt = _pyplot()
    limited = [r for r in report["results"] if r["capacity_tokens"] is not None]
    limited.sort(key=lambda r: r["capacity_tokens"])
    unlimited = [r for r in report["results"] if r["capacity_tokens"] is None]
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.plot(
        [r["capacity_tokens"] for r in limited],
        [100 * r["hit_rate"] for r in limited],
        marker="o",
    )
    for r in unlimited:
        axes.axhline(100 * r["hit_rate"], linestyle="--", color="grey", label="unlimited")
    if len(limited) > 1:
        axes.set_xscale("log")
    axes.set_xlabel("KV-cache capacity (tokens)")
    axes.set_ylabel("prefix-cache token hit rate (%)")
    axes.set_title(
        f"{report['trace']['name']}: hit rate vs capacity "
        f"(block size {report['config']['block_size']})"
    )
    axes.grid(True, which="both", alpha=0.3)
    if unlimited:
        axes.legend()
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)


def plot_serve(report: dict[str, Any], result: ServeResult, path: str | Path) -> None:
    """KV usage, running and waiting requests per step, against simulated time."""
    plt = _pyplot()
    times = list(result.step_start_s)
    figure, (usage_axes, queue_axes) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    usage_axes.plot(times, [100 * value for value in result.step_usage], color="tab:blue")
    usage_axes.set_ylabel("KV usage (%)")
    usage_axes.set_ylim(0, 105)
    usage_axes.grid(True, alpha=0.3)
    queue_axes.plot(times, list(result.step_num_running), label="running", color="tab:green")
    queue_axes.plot(times, list(result.step_num_waiting), label="waiting", color="tab:red")
    queue_axes.set_ylabel("requests")
    queue_axes.set_xlabel("simulated time (s)")
    queue_axes.legend()
    queue_axes.grid(True, alpha=0.3)
    usage_axes.set_title(f"{report['trace']['name']}: serve ({report['config']['profile']})")
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)


def plot_memory(report: dict[str, Any], path: str | Path) -> None:
    """Hit rate and TTFT (p50, p90) against KV memory (GiB, log scale); the GPU's size dashed."""
    plt = _pyplot()
    results = report["results"]
    config = report["config"]
    gib = [r["kv_memory_bytes"] / 2**30 for r in results]
    gpu_gib = config["gpu_num_blocks"] * config["block_size"] * config["kv_bytes_per_token"] / 2**30
    figure, (hit_axes, ttft_axes) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    hit_axes.plot(gib, [100 * r["hit_rate"] for r in results], marker="o")
    hit_axes.set_ylabel("prefix-cache hit rate (%)")
    for quantile, style in (("p50", "o-"), ("p90", "s--")):
        ttft = [r["ttft_s"][quantile] for r in results]
        ttft_axes.plot(gib, ttft, style, label=f"TTFT {quantile}")
    ttft_axes.set_ylabel("time to first token (s)")
    ttft_axes.set_xlabel("KV-cache memory (GiB)")
    ttft_axes.legend()
    for axes in (hit_axes, ttft_axes):
        axes.axvline(gpu_gib, linestyle=":", color="grey")
        axes.grid(True, which="both", alpha=0.3)
    if len(gib) > 1:
        ttft_axes.set_xscale("log", base=2)
        ttft_axes.set_xticks(gib, [f"{value:,.1f}" for value in gib])
        ttft_axes.minorticks_off()
    hit_axes.set_title(
        f"What KV memory buys: {report['trace']['name']}, "
        f"{config['profile'] or 'custom cost model'}\n(dotted line: the GPU's KV memory)",
        fontsize=10,
    )
    figure.tight_layout()
    save_figure(figure, path)
    plt.close(figure)
