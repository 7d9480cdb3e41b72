"""Simulator report layer, rendering: any mode's report as a terminal table with its notes,
with rich when it is installed (imported lazily), as plain text otherwise.

The report holds only simulated quantities, so the same inputs give byte-identical JSON;
wall-clock speed travels separately (`Speed`) and is shown in the table only.
"""

from __future__ import annotations

import errno
import os
import sys
from typing import Any

from pagedkv.sim.report.eviction import eviction_rows
from pagedkv.sim.report.format import SPARK_RAMP, SPARK_RAMP_ASCII, Speed
from pagedkv.sim.report.memory import memory_rows
from pagedkv.sim.report.replay import replay_rows
from pagedkv.sim.report.serve import serve_rows

_UNWRAPPED_WIDTH = 500  # columns rich may use when stdout is no terminal


def _rows(
    report: dict[str, Any], speed: Speed | None
) -> tuple[str, list[str], list[list[str]], list[tuple[str, str]]]:
    """Title, table header, table rows and (label, value) notes for either mode."""
    if report["mode"] == "sweep":
        return _sweep_rows(report, speed)
    trace = report["trace"]
    title = (
        f"pagedkv simulate ({report['mode']}): {trace['name']}: {trace['num_requests']:,} "
        f"requests, {trace['num_prompt_tokens']:,} prompt tokens over {trace['duration_s']:,.0f} s"
    )
    if report["mode"] == "serve" and report["results"].get("interrupted"):
        title += " (INTERRUPTED)"
    notes: list[tuple[str, str]] = []
    if report["mode"] == "replay" and "policies" in report["config"]:
        header, rows = eviction_rows(report, notes)
    elif report["mode"] == "replay":
        header, rows = replay_rows(report, notes)
    elif report["mode"] == "memory":
        header, rows = memory_rows(report, notes)
        if "plot" in report:
            notes.append(("plot", report["plot"]))
    else:
        header, rows = serve_rows(report, notes)
    if speed is not None:
        notes.append(
            (
                "simulator speed",
                f"{speed.wall_s:.1f} s wall, {speed.prompt_tokens_per_s:,.0f} simulated prompt "
                "tokens/s" + (f", {speed.steps_per_s:,.0f} steps/s" if speed.num_steps else ""),
            )
        )
    return title, header, rows, notes


def _sweep_rows(
    report: dict[str, Any], speed: Speed | None
) -> tuple[str, list[str], list[list[str]], list[tuple[str, str]]]:
    from pagedkv.sim.report.sweep import sweep_rows

    names = ", ".join(trace["name"] for trace in report["traces"])
    mode, num_cells = report["sweep_mode"], report["num_cells"]
    title = f"pagedkv simulate (sweep, {mode}): {num_cells:,} cells of {names}"
    header, rows = sweep_rows(report)
    notes: list[tuple[str, str]] = []
    if speed is not None:
        cells_per_s = report["num_cells"] / speed.wall_s if speed.wall_s > 0 else 0.0
        notes.append(("simulator speed", f"{speed.wall_s:.1f} s wall, {cells_per_s:.2f} cells/s"))
    return title, header, rows, notes


def render_text(
    report: dict[str, Any], speed: Speed | None = None, ascii_only: bool = False
) -> str:
    """The report as plain text."""
    title, header, rows, notes = _rows(report, speed)
    if ascii_only:
        notes = [
            (label, value.translate(str.maketrans(SPARK_RAMP, SPARK_RAMP_ASCII)))
            for label, value in notes
        ]
    # A header cell may hold two lines (the name, then its unit).
    header_lines = [cell.split("\n") for cell in header]
    depth = max(len(cell) for cell in header_lines)
    header_rows = [
        [cell[line] if line < len(cell) else "" for cell in header_lines] for line in range(depth)
    ]
    widths = [
        max(len(str(cell)) for cell in column) for column in zip(*header_rows, *rows, strict=True)
    ]
    lines = [title, ""]
    for header_row in header_rows:
        lines.append(
            "  ".join(cell.rjust(width) for cell, width in zip(header_row, widths, strict=True))
        )
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
    from rich import box
    from rich.table import Table

    title, header, rows, notes = _rows(report, speed)
    console.print(title, style="bold", highlight=False)
    # No vertical rules: the main job's nine columns fit an 80-column terminal.
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
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


def print_report(report: dict[str, Any], speed: Speed | None) -> None:
    """Print the report on stdout: with rich if installed (never wrapped when stdout is no
    terminal), else as plain text (ASCII sparklines unless stdout takes UTF-8)."""
    try:
        import rich  # noqa: F401 - is it there?
    except ImportError:
        encoding = (getattr(sys.stdout, "encoding", None) or "").lower()
        sys.stdout.write(render_text(report, speed, ascii_only="utf" not in encoding))
        return
    # Piped or redirected: no terminal width to fit, so never wrap (rich would assume 80),
    # unless COLUMNS says how wide the reader's screen is.
    width = None if sys.stdout.isatty() or os.environ.get("COLUMNS") else _UNWRAPPED_WIDTH
    render_rich(report, speed, pipe_safe_console(width=width))


def pipe_safe_console(**options: Any) -> Any:
    """A rich `Console(**options)` whose broken pipe raises `BrokenPipeError`, as everywhere
    else in the CLI (rich's own answer is `SystemExit(1)`; `pagedkv.cli.main` exits 141)."""
    from rich.console import Console

    class PipeSafeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))

    return PipeSafeConsole(**options)
