"""Simulator layer: the memory study's report (JSON-ready dict) and its table rows.

Only simulated quantities, so the same inputs give byte-identical JSON. The answer line names
the smallest KV size that serves the whole trace about as fast as the largest one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.memory_study import MemoryPoint
from pagedkv.sim.serve import ServeConfig

GIB = 2**30
# "About as fast as the largest size": p50 TTFT within this factor of it, and no more requests
# rejected (too long for the pool) than it rejects.
NEEDS_TTFT_FACTOR = 1.2


def memory_report(
    trace: Trace,
    configs: Sequence[ServeConfig],
    points: Sequence[MemoryPoint],
    profile: dict[str, Any],
    time_scale_note: str,
) -> dict[str, Any]:
    """`profile`: name (None with --cost), kv_bytes_per_token, gpu_num_blocks (what the GPU
    holds at this block size). `configs` and `points` pair up, in increasing size."""
    base = configs[0]
    scheduler = asdict(base.scheduler)
    scheduler["stop_token_ids"] = list(scheduler["stop_token_ids"])
    del scheduler["max_model_len"]  # per size: a request must fit the pool
    duration_s = trace.duration_s * base.time_scale
    offered = trace.num_prompt_tokens / duration_s if duration_s > 0 else 0.0
    bytes_per_block = profile["kv_bytes_per_token"] * base.block_size
    results = [
        _result(config, point, bytes_per_block)
        for config, point in zip(configs, points, strict=True)
    ]
    return {
        "format": "pagedkv.simulate/1",
        "mode": "memory",
        "trace": trace.summary(),
        "config": {
            "profile": profile["name"],
            "cost_model": asdict(base.cost_model),
            "block_size": base.block_size,
            "kv_bytes_per_token": profile["kv_bytes_per_token"],
            "gpu_num_blocks": profile["gpu_num_blocks"],
            "time_scale": base.time_scale,
            "time_scale_note": time_scale_note,
            "policy": base.policy,
            "enable_prefix_caching": base.enable_prefix_caching,
            "hash_algorithm": base.hash_algorithm,
            "scheduler": scheduler,
        },
        "offered_prompt_tokens_per_s": float(f"{offered:.6g}"),
        "results": results,
        "needs_num_blocks": _needs(results),
    }


def _result(config: ServeConfig, point: MemoryPoint, bytes_per_block: int) -> dict[str, Any]:
    summary = point.summary
    return {
        "num_blocks": point.num_blocks,
        "capacity_tokens": point.num_blocks * config.block_size,
        "kv_memory_bytes": point.num_blocks * bytes_per_block,
        "max_model_len": config.max_model_len,
        "num_requests_completed": summary["num_requests_completed"],
        "num_requests_rejected": summary["num_requests_rejected"],
        "hit_rate": summary["prefix_cache"]["hit_rate"],
        "ttft_s": summary["ttft_s"],
        "tpot_s": summary["tpot_s"],
        "e2e_latency_s": summary["e2e_latency_s"],
        "num_preemptions": summary["preemptions"]["num_preemptions"],
        "peak_usage": summary["usage"]["peak"],
        "prompt_tokens_per_s": summary["throughput"]["prompt_tokens_per_s"],
        "simulated_time_s": summary["simulated_time_s"],
    }


def _needs(results: list[dict[str, Any]]) -> int | None:
    """The smallest size that rejects no more requests than the largest and has a p50 TTFT
    within NEEDS_TTFT_FACTOR of the largest size's (None if none does)."""
    largest = results[-1]
    largest_ttft = largest["ttft_s"]["p50"]
    if largest_ttft is None:
        return None  # no request finished at the largest size: nothing to compare with
    for result in results:
        ttft = result["ttft_s"]["p50"]
        if result["num_requests_rejected"] <= largest["num_requests_rejected"] and (
            ttft is not None and ttft <= NEEDS_TTFT_FACTOR * largest_ttft
        ):
            return int(result["num_blocks"])
    return None


def memory_rows(
    report: dict[str, Any], notes: list[tuple[str, str]]
) -> tuple[list[str], list[list[str]]]:
    """Table header and rows (one per KV size), and the notes below the table.

    Units sit in the two-line header, so the numbers stay short: the table fits 80 columns.
    """
    config = report["config"]
    results = report["results"]
    unit, unit_bytes = _memory_unit(min(r["kv_memory_bytes"] for r in results))
    header = [
        f"KV memory\n{unit}",
        "KV\ntokens",
        "hit\nrate %",
        "TTFT\np50 s",
        "TTFT\np90 s",
        "TPOT\np50 ms",
        "e2e\np50 s",
        "pre-\nempted",
        "re-\njected",
    ]
    rows = []
    for result in results:
        rows.append(
            [
                f"{result['kv_memory_bytes'] / unit_bytes:,.1f}",
                f"{result['capacity_tokens']:,}",
                f"{100 * result['hit_rate']:.2f}",
                _number(result["ttft_s"]["p50"]),
                _number(result["ttft_s"]["p90"]),
                _number(result["tpot_s"]["p50"], 1000, 1),
                _number(result["e2e_latency_s"]["p50"]),
                f"{result['num_preemptions']:,}",
                f"{result['num_requests_rejected']:,}",
            ]
        )
    gpu_bytes = config["gpu_num_blocks"] * config["block_size"] * config["kv_bytes_per_token"]
    profile = config["profile"] or "custom cost model"
    notes.append(
        (
            "setup",
            f"{profile}; its GPU holds {_bytes(gpu_bytes)} of KV cache "
            f"({config['gpu_num_blocks'] * config['block_size']:,} tokens); block size "
            f"{config['block_size']}; {config['policy']}, batch "
            f"{config['scheduler']['max_num_batched_tokens']:,} tokens / "
            f"{config['scheduler']['max_num_seqs']} seqs",
        )
    )
    notes.append(("load", config["time_scale_note"]))
    notes.append(("answer", _answer(report, gpu_bytes)))
    return header, rows


def _answer(report: dict[str, Any], gpu_bytes: int) -> str:
    results = report["results"]
    needs = report["needs_num_blocks"]
    if needs is None:
        return (
            "only the largest size tried serves this fast (p50 TTFT within "
            f"{NEEDS_TTFT_FACTOR:g}x): try larger sizes with --capacity"
        )
    chosen = next(r for r in results if r["num_blocks"] == needs)
    largest = results[-1]
    where = "fits on the GPU" if chosen["kv_memory_bytes"] <= gpu_bytes else "more than the GPU"
    answer = (
        f"{_bytes(chosen['kv_memory_bytes'])} ({where}) serves as many requests as the "
        f"largest size, with a p50 TTFT within {NEEDS_TTFT_FACTOR:g}x of its"
    )
    if chosen is largest:
        return answer
    gain = 100 * (largest["hit_rate"] - chosen["hit_rate"])
    more = _bytes(largest["kv_memory_bytes"])
    if abs(gain) < 0.05:
        return f"{answer}; {more} would not change the prefix-cache hit rate"
    return f"{answer}; {more} would move the hit rate by {gain:+.1f} points"


def _bytes(num_bytes: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:,.1f} {unit}"
    return f"{num_bytes:,.0f} B"


def _memory_unit(num_bytes: float) -> tuple[str, int]:
    """The unit of the memory column: the largest one the smallest size fills."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return unit, size
    return "bytes", 1


def _number(value: float | None, scale: float = 1.0, decimals: int = 2) -> str:
    """A latency in the column's unit; n/a when nothing was measured (no request finished)."""
    if value is None:
        return "n/a"
    return f"{value * scale:,.{decimals}f}"
