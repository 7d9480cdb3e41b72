"""Simulator layer: PNG plots of a report (needs matplotlib, imported lazily).

Replay: hit rate against capacity. Serve: KV usage, running and waiting requests over time.
Memory study: hit rate, TTFT, preemptions and rejections against KV memory, the answer marked.
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
    """The memory study's plot (`memory_figure`), written to `path`."""
    plt = _pyplot()
    figure = memory_figure(report, plt)
    save_figure(figure, path)
    plt.close(figure)


def memory_figure(report: dict[str, Any], plt: Any) -> Any:
    """Against KV memory (GiB, log scale): the hit rate on an axis from 0, TTFT p50 and p90,
    preemptions and rejected requests; the GPU's size dotted, the answer's size marked."""
    results = report["results"]
    config = report["config"]
    gib = [r["kv_memory_bytes"] / 2**30 for r in results]
    gpu_gib = config["gpu_num_blocks"] * config["block_size"] * config["kv_bytes_per_token"] / 2**30
    answer = next((r for r in results if r["num_blocks"] == report["needs_num_blocks"]), None)
    figure, (hit_axes, ttft_axes, count_axes) = plt.subplots(
        3, 1, figsize=(7, 8), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1.3]}
    )
    hit_rates = [100 * r["hit_rate"] for r in results]
    hit_axes.plot(gib, hit_rates, marker="o")
    for x, y in zip(gib, hit_rates, strict=True):
        hit_axes.annotate(f"{y:.2f} %", (x, y), textcoords="offset points", xytext=(0, 6),
                          ha="center", fontsize=8)  # fmt: skip
    # From 0: a difference of a tenth of a point looks like one, not like a cliff.
    hit_axes.set_ylim(0, max(1.0, 1.3 * max(hit_rates)))
    hit_axes.set_ylabel("prefix-cache hit rate (%)")
    for quantile, style in (("p50", "o-"), ("p90", "s--")):
        points = [(x, r["ttft_s"][quantile]) for x, r in zip(gib, results, strict=True)]
        points = [(x, y) for x, y in points if y is not None]  # no request finished there
        ttft_axes.plot(
            [x for x, _ in points], [y for _, y in points], style, label=f"TTFT {quantile}"
        )
    ttft_axes.set_ylim(bottom=0)
    ttft_axes.set_ylabel("time to first token (s)")
    ttft_axes.legend(loc="best")
    width = [x * 0.12 for x in gib]  # bars of equal width on the log axis
    preempted = [r["num_preemptions"] for r in results]
    rejected = [r["num_requests_rejected"] for r in results]
    count_axes.bar([x / 1.07 for x in gib], preempted, width=width, label="preemptions")
    count_axes.bar([x * 1.07 for x in gib], rejected, width=width, label="rejected requests")
    count_axes.set_ylim(0, max(1, *preempted, *rejected) * 1.25)
    count_axes.set_ylabel("count")
    count_axes.yaxis.get_major_locator().set_params(integer=True)
    count_axes.set_xlabel("KV-cache memory (GiB)")
    count_axes.legend(loc="upper right")
    for axes in (hit_axes, ttft_axes, count_axes):
        axes.axvline(gpu_gib, linestyle=":", color="grey", label="_the GPU's KV memory")
        if answer is not None:
            axes.axvline(answer["kv_memory_bytes"] / 2**30, color="tab:green", alpha=0.35,
                         linewidth=6, label="answer")  # fmt: skip
        axes.grid(True, which="major", alpha=0.3)
    if len(gib) > 1:
        count_axes.set_xscale("log", base=2)
        count_axes.set_xticks(gib, [f"{value:,.1f}" for value in gib])
        count_axes.minorticks_off()
    if answer is not None:
        answer_gib = answer["kv_memory_bytes"] / 2**30
        hit_axes.annotate(f"answer: {answer_gib:,.1f} GiB", (answer_gib, 0.02),
                          xycoords=("data", "axes fraction"), xytext=(6, 0),
                          textcoords="offset points", color="tab:green", fontsize=9)  # fmt: skip
    hit_axes.set_title(
        f"What KV memory buys: {report['trace']['name']}, "
        f"{config['profile'] or 'custom cost model'}\n(dotted: the GPU's KV memory; "
        "green: the answer, as fast as the largest size)",
        fontsize=10,
    )
    figure.tight_layout()
    return figure
