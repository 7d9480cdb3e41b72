"""Simulator layer: a report as tidy rows (one per cell and metric), written as Parquet or CSV.

Every mode's report becomes rows of `COLUMNS`: what identifies the cell (trace, block size,
profile, eviction policy, capacity, and a `key` for a cluster's router), then one metric name
(nested results joined with dots: `ttft_s.p50`) and its value. `pandas.read_parquet` /
`polars.read_parquet` (or `read_csv`) load it as it is; a pivot on `metric` gives one column
per metric. The command line and pagedkv's version travel with the file: Parquet key-value
metadata, or for CSV a sidecar `PATH.meta.json`. Writes are atomic (a temporary file in the
same folder, then a rename). pyarrow (extra `[parquet]`) is imported only to write Parquet.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pagedkv.atomic_file import atomic_write
from pagedkv.errors import InvalidArgumentError, install_hint

COLUMNS = (
    "mode",
    "trace",
    "block_size",
    "profile",
    "policy",
    "capacity_blocks",
    "key",
    "cell",
    "metric",
    "value",
)
FORMATS = {".parquet": "parquet", ".csv": "csv"}
META_SUFFIX = ".meta.json"
# Results entries that identify a cell rather than measure it.
_CELL_FIELDS = {"capacity_blocks", "capacity_tokens", "policy", "router", "num_blocks"}

Row = tuple[Any, ...]


def output_format(path: str) -> str:
    """`parquet` or `csv` from the path's extension; refuses any other, and a folder that
    does not exist, before any work. Parquet needs pyarrow."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise InvalidArgumentError(
            f"--output {path!r}: the extension picks the format: .parquet or .csv"
        )
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise InvalidArgumentError(f"--output {path!r}: folder {str(folder)!r} does not exist")
    if Path(path).is_dir():
        raise InvalidArgumentError(f"--output {path!r} is a folder")
    if not os.access(folder, os.W_OK):
        raise InvalidArgumentError(f"--output {path!r}: folder {str(folder)!r} is not writable")
    if FORMATS[suffix] == "parquet":
        from importlib.util import find_spec

        if find_spec("pyarrow") is None:
            raise InvalidArgumentError(
                f"--output .parquet needs pyarrow: {install_hint('parquet')} (or use .csv)"
            )
    return FORMATS[suffix]


def report_rows(report: dict[str, Any]) -> list[Row]:
    """The report's rows, in `COLUMNS` order: cells in report order, metrics sorted by name."""
    rows: list[Row] = []
    for index, (cell, metrics) in enumerate(_cells(report)):
        identity = (
            report["mode"],
            cell.get("trace"),
            cell.get("block_size"),
            cell.get("profile"),
            cell.get("policy"),
            cell.get("capacity_blocks"),
            cell.get("key"),
            index,
        )
        for name, value in sorted(_flatten(metrics)):
            rows.append((*identity, name, value))
    return rows


def _cells(report: dict[str, Any]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """(cell identity, its results) for every cell of the report, whatever its mode."""
    mode = report["mode"]
    config = report.get("config", {})
    if mode == "sweep":
        for cell in report["cells"]:
            yield {key: cell[key] for key in cell if key != "result"}, cell["result"]
        return
    base = {
        "trace": report["trace"]["name"],
        "block_size": config.get("block_size"),
        "profile": config.get("profile"),
        "policy": config.get("eviction", "lru"),
    }
    results = report["results"]
    if isinstance(results, dict):  # serve: one cell
        yield {**base, "capacity_blocks": config.get("num_blocks")}, results
        return
    for result in results:
        cell = dict(base)
        if "policy" in result:
            cell["policy"] = result["policy"]
        cell["capacity_blocks"] = result.get("capacity_blocks", result.get("num_blocks"))
        if "router" in result:
            cell["key"] = result["router"]
            cell["capacity_blocks"] = config.get("num_blocks")
        yield cell, {key: value for key, value in result.items() if key not in _CELL_FIELDS}


def _flatten(metrics: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float | None]]:
    """Numeric leaves (bools as 0/1, None kept), nested names joined with dots; strings and
    lists (a timeline, per-instance lists) are not metrics and are left out."""
    for name, value in metrics.items():
        full = f"{prefix}{name}"
        if isinstance(value, dict):
            yield from _flatten(value, full + ".")
        elif value is None:
            yield full, None
        elif isinstance(value, bool):
            yield full, float(value)
        elif isinstance(value, int | float):
            yield full, float(value)


def metadata(report: dict[str, Any], command: list[str]) -> dict[str, str]:
    """What travels with the rows: the command line, pagedkv's version, the report's format,
    mode and shared settings (JSON)."""
    import shlex

    from pagedkv import __version__

    return {
        "pagedkv.command": shlex.join(command),
        "pagedkv.version": __version__,
        "pagedkv.format": report.get("format", ""),
        "pagedkv.mode": report["mode"],
        "pagedkv.config": json.dumps(report.get("config", {}), sort_keys=True),
    }


def write_results(path: str, report: dict[str, Any], command: list[str]) -> int:
    """Write the report's rows to `path` (its extension picks the format); return the number
    of rows. CSV also writes `path + META_SUFFIX` with the metadata."""
    kind = output_format(path)
    rows = report_rows(report)
    meta = metadata(report, command)
    if kind == "parquet":
        _write_atomic(path, _parquet_bytes(rows, meta))
    else:
        text = io.StringIO()
        writer = csv.writer(text, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(["" if cell is None else cell for cell in row] for row in rows)
        _write_atomic(path, text.getvalue().encode("utf-8"))
        sidecar = {**meta, "columns": list(COLUMNS), "num_rows": len(rows)}
        _write_atomic(path + META_SUFFIX, (json.dumps(sidecar, indent=2) + "\n").encode())
    return len(rows)


def _parquet_bytes(rows: list[Row], meta: dict[str, str]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = pa.schema(
        [
            ("mode", pa.string()),
            ("trace", pa.string()),
            ("block_size", pa.int64()),
            ("profile", pa.string()),
            ("policy", pa.string()),
            ("capacity_blocks", pa.int64()),
            ("key", pa.string()),
            ("cell", pa.int64()),
            ("metric", pa.string()),
            ("value", pa.float64()),
        ],
        metadata=meta,
    )
    columns = list(zip(*rows, strict=True)) if rows else [() for _ in COLUMNS]
    table = pa.Table.from_arrays(
        [
            pa.array(list(values), type=field.type)
            for values, field in zip(columns, schema, strict=True)
        ],
        schema=schema,
    )
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return bytes(sink.getvalue().to_pybytes())


def _write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` whole or not at all (`pagedkv.atomic_file`)."""
    with atomic_write(path) as file:
        file.write(data)
