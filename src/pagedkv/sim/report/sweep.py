"""Simulator report layer: a sweep's report (one entry per cell, in grid order) and its table."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.report.format import REPORT_FORMAT
from pagedkv.sim.sweep import SweepCell


def sweep_report(
    mode: str,
    traces: Sequence[Trace],
    cells: Sequence[SweepCell],
    results: Sequence[dict[str, Any]],
    config: dict[str, Any],
) -> dict[str, Any]:
    """The sweep as a JSON-ready dict: what it varied, the settings all cells share, the
    traces, and one entry per cell (its axis values and its result), in cell order."""
    return {
        "format": REPORT_FORMAT,
        "mode": "sweep",
        "sweep_mode": mode,
        "config": config,
        "traces": [trace.summary() for trace in traces],
        "num_cells": len(cells),
        "cells": [
            {
                "trace": traces[cell.trace_index].name,
                "block_size": cell.block_size,
                "profile": cell.profile,
                "policy": cell.policy,
                "capacity_blocks": cell.capacity_blocks,
                "capacity_tokens": (
                    None if cell.capacity_blocks is None else cell.capacity_blocks * cell.block_size
                ),
                "result": result,
            }
            for cell, result in zip(cells, results, strict=True)
        ],
    }


def sweep_rows(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The table of a sweep report: one row per cell, the mode's key results."""
    header = ["trace", "block", "profile", "policy", "capacity (tokens)"]
    if report["sweep_mode"] == "replay":
        header += ["hit rate", "not fit"]
    else:
        header += ["TTFT p50 (s)", "TPOT p50 (ms)", "hit rate", "preemptions", "rejected"]
    rows = []
    for cell in report["cells"]:
        result = cell["result"]
        tokens = cell["capacity_tokens"]
        capacity = "unlimited" if tokens is None else f"{tokens:,}"
        row = [
            cell["trace"],
            str(cell["block_size"]),
            cell["profile"] or "-",
            cell["policy"],
            capacity,
        ]
        if report["sweep_mode"] == "replay":
            row += [f"{100 * result['hit_rate']:.2f} %", f"{result['num_requests_not_fit']:,}"]
        else:
            ttft, tpot = result["ttft_s"]["p50"], result["tpot_s"]["p50"]
            row += [
                "n/a" if ttft is None else f"{ttft:.3g}",
                "n/a" if tpot is None else f"{1000 * tpot:.3g}",
                f"{100 * result['prefix_cache']['hit_rate']:.2f} %",
                f"{result['preemptions']['num_preemptions']:,}",
                f"{result['num_requests_rejected']:,}",
            ]
        rows.append(row)
    return header, rows
