"""Simulator layer: request traces and their loaders (Mooncake JSONL, plain JSONL).

A trace request stores a recipe for its token ids (runs of consecutive ids), not the ids, so a
145 M-token trace stays small; the ids are built on demand with C-speed list operations.
Knows nothing of the scheduler or the manager.
"""

from __future__ import annotations

import json
import math
import os
import stat
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from pagedkv.bounded_read import LineTooLongError, iter_lines
from pagedkv.errors import HostMemoryError, InvalidArgumentError
from pagedkv.memory_guard import MemoryBudget, available_memory_bytes, format_bytes

# One Mooncake hash id covers this many prompt tokens (the last block of a prompt is partial).
TRACE_BLOCK_TOKENS = 512
# Prompt token ids live in [0, OUTPUT_TOKEN_BASE), generated output ids in
# [OUTPUT_TOKEN_BASE, 2**32): the two never collide.
OUTPUT_TOKEN_BASE = 2**31
MAX_TOKEN_ID = 2**32 - 1
MAX_TRACE_BLOCKS = OUTPUT_TOKEN_BASE // TRACE_BLOCK_TOKENS
# Arrival times up to ~317 years (Unix-epoch milliseconds fit): a float64 of seconds still
# resolves microseconds there, so latencies stay exact; beyond it they would silently round.
MAX_TIMESTAMP_MS = 10**13
# Memory estimates (tracemalloc, CPython 3.11): parsing a line takes up to ~25 bytes per byte
# of it (an empty list per 3 bytes in `[[],[],...]`); a kept request ~560 bytes plus ~120 per
# run, ~36 per explicit token id and ~100 per distinct trace block id.
_PARSE_BYTES_PER_LINE_BYTE = 25
_KEPT_BYTES_PER_REQUEST = 600
_KEPT_BYTES_PER_RUN = 120
_KEPT_BYTES_PER_TOKEN_ID = 36
_KEPT_BYTES_PER_BLOCK_ID = 100

TokenRun = tuple[int, int]  # (first token id, number of tokens): ids first, first+1, ...


class TraceFormatError(InvalidArgumentError):
    """A trace file line is malformed; names the file, the 1-based line and the field."""

    def __init__(self, path: str, line_number: int, field: str | None, problem: str) -> None:
        self.path = path
        self.line_number = line_number
        self.field = field
        where = f"{path}:{line_number}"
        what = f"field {field!r}: " if field else ""
        super().__init__(f"{where}: {what}{problem}")


class TraceWarning(UserWarning):
    """A trace was usable but needed fixing (for example unsorted timestamps)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    The prompt is the concatenation of `prompt_runs` (or `explicit_prompt` when the trace gave
    token ids); output token i is `output_token_start + i`. `session_id`: the conversation it
    belongs to (given by the trace, or derived for Mooncake records: `_SessionDeriver`);
    `turn_index`: its place in that session, 0 first.
    """

    request_id: str
    arrival_time_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_runs: tuple[TokenRun, ...]
    output_token_start: int
    priority: int = 0
    explicit_prompt: tuple[int, ...] | None = None
    session_id: str | None = None
    turn_index: int = 0

    def prompt_token_ids(self) -> list[int]:
        """Build the prompt's token ids."""
        if self.explicit_prompt is not None:
            return list(self.explicit_prompt)
        tokens: list[int] = []
        # Hot path: one C-level extend per run, no per-token Python work.
        for first, num_tokens in self.prompt_runs:
            tokens += range(first, first + num_tokens)
        return tokens

    def output_token_id(self, index: int) -> int:
        return self.output_token_start + index


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival time, with where they came from."""

    name: str
    requests: tuple[TraceRequest, ...]
    source: str

    @property
    def num_prompt_tokens(self) -> int:
        return sum(request.num_prompt_tokens for request in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(request.num_output_tokens for request in self.requests)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return self.requests[-1].arrival_time_s - self.requests[0].arrival_time_s

    @property
    def max_request_tokens(self) -> int:
        return max((r.num_prompt_tokens + r.num_output_tokens for r in self.requests), default=0)

    def summary(self) -> dict[str, object]:
        return {
            "name": self.name,
            "num_requests": len(self.requests),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_output_tokens": self.num_output_tokens,
            "duration_s": round(self.duration_s, 6),
        }


def sort_by_arrival(requests: Sequence[TraceRequest], source: str) -> tuple[TraceRequest, ...]:
    """Stable-sort by arrival time, warning if the input was not sorted."""
    for index in range(1, len(requests)):
        if requests[index].arrival_time_s < requests[index - 1].arrival_time_s:
            warnings.warn(
                f"{source}: timestamps are not sorted (request {requests[index].request_id} "
                "arrives before the one above it); sorted them by timestamp",
                TraceWarning,
                stacklevel=3,
            )
            return tuple(sorted(requests, key=lambda request: request.arrival_time_s))
    return tuple(requests)


def assign_output_tokens(requests: Iterable[TraceRequest], source: str) -> tuple[TraceRequest, ...]:
    """Give each request its own run of output ids, in order, from `OUTPUT_TOKEN_BASE`."""
    result = []
    next_output = OUTPUT_TOKEN_BASE
    for request in requests:
        if next_output + request.num_output_tokens - 1 > MAX_TOKEN_ID:
            raise InvalidArgumentError(
                f"{source}: more than {MAX_TOKEN_ID - OUTPUT_TOKEN_BASE + 1} output tokens in "
                "total; simulate a shorter trace"
            )
        result.append(_with_output_start(request, next_output))
        next_output += request.num_output_tokens
    return tuple(result)


def _with_output_start(request: TraceRequest, output_token_start: int) -> TraceRequest:
    return TraceRequest(
        request.request_id,
        request.arrival_time_s,
        request.num_prompt_tokens,
        request.num_output_tokens,
        request.prompt_runs,
        output_token_start,
        request.priority,
        request.explicit_prompt,
        request.session_id,
        request.turn_index,
    )


# ----------------------------------------------------------------------------- loading

MIN_SESSION_PREFIX_BLOCKS = 2
"""A next turn extends at least this many of its previous turn's 512-token blocks."""


class _SessionDeriver:
    """Sessions for Mooncake records, which carry none, read from the chained hash ids.

    Rule: request B is the next turn of the most recent earlier request A whose full blocks
    (all of A's ids but a partial last one) B's ids start with, provided that is at least
    `MIN_SESSION_PREFIX_BLOCKS` blocks (one block alone is the conversation trace's system
    prompt, shared by every request) and A has no next turn yet (a second request extending
    A is a retry or a branch: a session of its own). A's output enters B's prompt under new
    ids, so B extends A's full blocks, not its partial last one. Requests are taken in file
    order (Mooncake files are sorted by timestamp). Each request costs one dict probe per
    block, longest prefix first, stopping at the first hit.
    """

    def __init__(self) -> None:
        # The id of a request's last full block -> [session id, turn index, continued?].
        self._last_full_block: dict[int, list] = {}

    def derive(self, hash_ids: Sequence[int], num_tokens: int, line_number: int) -> tuple[str, int]:
        """(session id, turn index) of a request, recording it as a possible previous turn."""
        table = self._last_full_block
        session_id, turn = f"S{line_number}", 0
        for num_blocks in range(len(hash_ids), MIN_SESSION_PREFIX_BLOCKS - 1, -1):
            entry = table.get(hash_ids[num_blocks - 1])
            if entry is not None:
                if not entry[2]:
                    entry[2] = True
                    session_id, turn = entry[0], entry[1] + 1
                break
        num_full = num_tokens // TRACE_BLOCK_TOKENS
        if num_full >= MIN_SESSION_PREFIX_BLOCKS:
            table[hash_ids[num_full - 1]] = [session_id, turn, False]
        return session_id, turn


class _LineParser:
    """Parses one trace file line by line; maps trace block ids to token runs.

    Trace block id `h` (first seen as the d-th distinct id) becomes the token ids
    `d*512 ... d*512 + n - 1` for a block of n tokens: equal ids give equal tokens, distinct
    ids give distinct tokens at every position.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.sessions = _SessionDeriver()
        self.id_to_dense: dict[int, int] = {}
        self.num_dense = 0  # dense ids handed out: trace ids and fresh blocks

    def _reserve_dense(self, line_number: int, field: str, num_blocks: int) -> int:
        """The first of `num_blocks` new consecutive dense ids (checked before any is used)."""
        first = self.num_dense
        if first + num_blocks > MAX_TRACE_BLOCKS:
            raise TraceFormatError(
                self.path,
                line_number,
                field,
                f"more than {MAX_TRACE_BLOCKS:,} distinct {TRACE_BLOCK_TOKENS}-token blocks in "
                f"one trace ({MAX_TRACE_BLOCKS * TRACE_BLOCK_TOKENS:,} prompt tokens)",
            )
        self.num_dense = first + num_blocks
        return first

    def _dense(self, line_number: int, block_id: int) -> int:
        dense = self.id_to_dense.get(block_id)
        if dense is None:
            dense = self._reserve_dense(line_number, "hash_ids", 1)
            self.id_to_dense[block_id] = dense
        return dense

    def parse(self, line_number: int, text: str) -> TraceRequest:
        path = self.path
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(path, line_number, None, f"not valid JSON ({exc.msg})") from None
        except (ValueError, RecursionError) as exc:  # a 5,000-digit int; 10,000 nested lists
            problem = str(exc).split(";")[0]  # not the hint to raise Python's digit limit
            raise TraceFormatError(
                path, line_number, None, f"not usable JSON ({problem})"
            ) from None
        if not isinstance(record, dict):
            raise TraceFormatError(path, line_number, None, "expected a JSON object")
        output_length = self._int(record, line_number, "output_length", 1)
        priority = self._int(record, line_number, "priority", None, default=0)
        session = self._session(record, line_number)
        if "hash_ids" in record:
            timestamp_ms = self._timestamp(record, line_number, required=True)
            runs, num_tokens = self._hash_id_runs(record, line_number)
            explicit = None
            if session is None:
                session = self.sessions.derive(record["hash_ids"], num_tokens, line_number)
        elif "prompt_token_ids" in record:
            timestamp_ms = self._timestamp(record, line_number, required=False)
            explicit = self._token_ids(record, line_number)
            runs, num_tokens = (), len(explicit)
        elif "input_length" in record:
            timestamp_ms = self._timestamp(record, line_number, required=False)
            num_tokens = self._int(record, line_number, "input_length", 1)
            # Fresh blocks nobody else has, consecutive, so one run covers the whole prompt.
            num_blocks = -(-num_tokens // TRACE_BLOCK_TOKENS)
            first = self._reserve_dense(line_number, "input_length", num_blocks)
            runs, explicit = ((first * TRACE_BLOCK_TOKENS, num_tokens),), None
        else:
            raise TraceFormatError(
                path,
                line_number,
                None,
                "needs 'hash_ids' (Mooncake), 'prompt_token_ids' or 'input_length'",
            )
        return TraceRequest(
            request_id=f"L{line_number}",
            arrival_time_s=timestamp_ms / 1000.0,
            num_prompt_tokens=num_tokens,
            num_output_tokens=output_length,
            prompt_runs=runs,
            output_token_start=OUTPUT_TOKEN_BASE,
            priority=priority,
            explicit_prompt=explicit,
            session_id=None if session is None else session[0],
            turn_index=0 if session is None else session[1],
        )

    def _session(self, record: dict, line_number: int) -> tuple[str, int] | None:
        """A record's own `session_id` (a str or an int) and `turn_index` (default 0)."""
        if "session_id" not in record:
            return None
        session_id = record["session_id"]
        if isinstance(session_id, bool) or not isinstance(session_id, (str, int)):
            raise TraceFormatError(
                self.path,
                line_number,
                "session_id",
                f"expected a string or an int, got {session_id!r}",
            )
        turn = self._int(record, line_number, "turn_index", 0, default=0)
        return str(session_id), turn

    def _int(
        self, record: dict, line_number: int, field: str, minimum: int | None, default=None
    ) -> int:
        if field not in record:
            if default is not None:
                return default
            raise TraceFormatError(self.path, line_number, field, "missing")
        value = record[field]
        if not isinstance(value, int) or isinstance(value, bool):
            raise TraceFormatError(self.path, line_number, field, f"expected an int, got {value!r}")
        if minimum is not None and value < minimum:
            raise TraceFormatError(
                self.path, line_number, field, f"must be >= {minimum}, got {value}"
            )
        return value

    def _timestamp(self, record: dict, line_number: int, required: bool) -> float:
        if "timestamp" not in record:
            if required:
                raise TraceFormatError(self.path, line_number, "timestamp", "missing")
            return 0.0
        value = record["timestamp"]
        if (
            not isinstance(value, (int, float))
            or isinstance(value, bool)
            or not math.isfinite(value)
            or not 0 <= value <= MAX_TIMESTAMP_MS
        ):
            raise TraceFormatError(
                self.path,
                line_number,
                "timestamp",
                f"expected milliseconds in [0, {MAX_TIMESTAMP_MS:.0e}], got {value!r}",
            )
        return float(value)

    def _hash_id_runs(self, record: dict, line_number: int) -> tuple[tuple[TokenRun, ...], int]:
        num_tokens = self._int(record, line_number, "input_length", 1)
        hash_ids = record["hash_ids"]
        if not isinstance(hash_ids, list):
            raise TraceFormatError(
                self.path, line_number, "hash_ids", f"expected a list, got {hash_ids!r}"
            )
        num_blocks = -(-num_tokens // TRACE_BLOCK_TOKENS)
        if len(hash_ids) != num_blocks:  # checked before any list of that length is built
            raise TraceFormatError(
                self.path,
                line_number,
                "hash_ids",
                f"has {len(hash_ids)} ids; input_length {num_tokens} needs "
                f"ceil({num_tokens}/{TRACE_BLOCK_TOKENS}) = {num_blocks}",
            )
        sizes = _block_sizes(num_tokens)
        runs = []
        for block_id, size in zip(hash_ids, sizes, strict=True):
            if not isinstance(block_id, int) or isinstance(block_id, bool) or block_id < 0:
                raise TraceFormatError(
                    self.path,
                    line_number,
                    "hash_ids",
                    f"ids must be ints >= 0, got {block_id!r}",
                )
            runs.append((self._dense(line_number, block_id) * TRACE_BLOCK_TOKENS, size))
        return _merge_runs(runs), num_tokens

    def _token_ids(self, record: dict, line_number: int) -> tuple[int, ...]:
        tokens = record["prompt_token_ids"]
        if not isinstance(tokens, list) or not tokens:
            raise TraceFormatError(
                self.path, line_number, "prompt_token_ids", "expected a non-empty list of ints"
            )
        for position, token in enumerate(tokens):
            if (
                not isinstance(token, int)
                or isinstance(token, bool)
                or not (0 <= token <= MAX_TOKEN_ID)
            ):
                raise TraceFormatError(
                    self.path,
                    line_number,
                    "prompt_token_ids",
                    f"position {position}: {token!r} is not a token id in [0, {MAX_TOKEN_ID}]",
                )
        return tuple(tokens)


def _block_sizes(num_tokens: int) -> list[int]:
    """Sizes of the 512-token trace blocks covering a prompt (the last may be partial)."""
    num_full, remainder = divmod(num_tokens, TRACE_BLOCK_TOKENS)
    return [TRACE_BLOCK_TOKENS] * num_full + ([remainder] if remainder else [])


def _merge_runs(runs: Iterable[TokenRun]) -> tuple[TokenRun, ...]:
    """Join runs that continue each other, so a fresh prompt becomes a single run."""
    merged: list[TokenRun] = []
    for first, num_tokens in runs:
        if merged and merged[-1][0] + merged[-1][1] == first:
            merged[-1] = (merged[-1][0], merged[-1][1] + num_tokens)
        else:
            merged.append((first, num_tokens))
    return tuple(merged)


def load_trace(path: str | Path, limit: int | None = None, name: str | None = None) -> Trace:
    """Load a JSONL trace (Mooncake records, token ids or lengths; see docs/simulate.md).

    Reads the whole file (or its first `limit` requests) and validates every line before
    returning; raises `TraceFormatError` on the first bad line (not UTF-8 JSON, a bad field).
    Memory is estimated line by line before it is spent, whatever `path` is (a file, a FIFO, a
    device, stdin): a line too long to parse, or a trace whose requests would not fit, raises
    `HostMemoryError` (having held at most that line's budget); blank lines in a row past that
    budget raise `InputTooLargeError` (an endless stream of newlines). Unsorted timestamps are
    sorted with a `TraceWarning`.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise InvalidArgumentError(f"limit must be >= 1, got {limit}")
    source = str(path)
    parser = _LineParser(source)
    requests: list[TraceRequest] = []
    budget = MemoryBudget(f"loading {source}", "line")
    available_bytes = available_memory_bytes()
    max_line_bytes = (
        None if available_bytes is None else available_bytes // _PARSE_BYTES_PER_LINE_BYTE
    )
    with path.open("rb") as file:
        lines: Iterable[tuple[int, bytes]] = enumerate(file, start=1)
        line_budget = _line_budget(file, max_line_bytes)
        if line_budget is not None:
            # Hot path: only an input that may hold a line past the budget is read in bounded
            # chunks: a big file, or a stream (a FIFO, a device such as /dev/zero, stdin),
            # whose size says nothing. It also bounds a run of blank lines.
            lines = iter_lines(file, line_budget, source)
        line_number = 0
        try:
            for line_number, raw in lines:
                text = _decode(source, line_number, raw)
                if not text.strip():
                    continue
                num_ids_before = len(parser.id_to_dense)
                request = parser.parse(line_number, text)
                requests.append(request)
                budget.add(
                    _KEPT_BYTES_PER_REQUEST
                    + _KEPT_BYTES_PER_RUN * len(request.prompt_runs)
                    + _KEPT_BYTES_PER_TOKEN_ID * len(request.explicit_prompt or ())
                    + _KEPT_BYTES_PER_BLOCK_ID * (len(parser.id_to_dense) - num_ids_before),
                    line_number,
                )
                if limit is not None and len(requests) >= limit:
                    break
        except LineTooLongError as exc:  # (a run of blank lines raises as it is)
            raise _line_too_long(
                source, exc.line_number or line_number + 1, exc.max_bytes, available_bytes
            ) from None
    if not requests:
        raise TraceFormatError(source, 1, None, "the trace has no requests")
    ordered = assign_output_tokens(sort_by_arrival(requests, source), source)
    return Trace(name or path.name, ordered, source)


def _line_budget(file: BinaryIO, max_line_bytes: int | None) -> int | None:
    """The byte budget `file`'s lines are read under; None where none is known, or where no
    line can pass it (a regular file no bigger than the budget)."""
    if max_line_bytes is None:
        return None
    file_stat = os.fstat(file.fileno())
    if stat.S_ISREG(file_stat.st_mode) and file_stat.st_size <= max_line_bytes:
        return None
    return max_line_bytes


def _decode(source: str, line_number: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TraceFormatError(
            source,
            line_number,
            None,
            f"not UTF-8 text (byte {raw[exc.start : exc.start + 1]!r} at column "
            f"{exc.start + 1}); a trace is a JSONL text file",
        ) from None


def _line_too_long(
    source: str, line_number: int, max_line_bytes: int, available_bytes: int | None
) -> HostMemoryError:
    return HostMemoryError(
        f"{source}:{line_number}: the line is longer than {format_bytes(max_line_bytes)}; "
        f"parsing it could take more than the {format_bytes(available_bytes or 0)} of memory "
        "this machine has available",
        max_line_bytes * _PARSE_BYTES_PER_LINE_BYTE,
        available_bytes or 0,
    )
