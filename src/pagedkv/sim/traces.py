"""Simulator layer: request traces and their loaders (Mooncake JSONL, plain JSONL).

A trace request stores a recipe for its token ids (runs of consecutive ids), not the ids, so a
145 M-token trace stays small; the ids are built on demand with C-speed list operations.
Knows nothing of the scheduler or the manager.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pagedkv.errors import InvalidArgumentError

# One Mooncake hash id covers this many prompt tokens (the last block of a prompt is partial).
TRACE_BLOCK_TOKENS = 512
# Prompt token ids live in [0, OUTPUT_TOKEN_BASE), generated output ids in
# [OUTPUT_TOKEN_BASE, 2**32): the two never collide.
OUTPUT_TOKEN_BASE = 2**31
MAX_TOKEN_ID = 2**32 - 1
MAX_TRACE_BLOCKS = OUTPUT_TOKEN_BASE // TRACE_BLOCK_TOKENS

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
    token ids); output token i is `output_token_start + i`.
    """

    request_id: str
    arrival_time_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    prompt_runs: tuple[TokenRun, ...]
    output_token_start: int
    priority: int = 0
    explicit_prompt: tuple[int, ...] | None = None

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
    )


# ----------------------------------------------------------------------------- loading


class _LineParser:
    """Parses one trace file line by line; maps trace block ids to token runs.

    Trace block id `h` (first seen as the d-th distinct id) becomes the token ids
    `d*512 ... d*512 + n - 1` for a block of n tokens: equal ids give equal tokens, distinct
    ids give distinct tokens at every position.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.id_to_dense: dict[int, int] = {}

    def _dense(self, line_number: int, block_id: int) -> int:
        dense = self.id_to_dense.get(block_id)
        if dense is None:
            dense = len(self.id_to_dense)
            if dense >= MAX_TRACE_BLOCKS:
                raise TraceFormatError(
                    self.path,
                    line_number,
                    "hash_ids",
                    f"more than {MAX_TRACE_BLOCKS} distinct blocks in one trace",
                )
            self.id_to_dense[block_id] = dense
        return dense

    def _fresh_dense(self, line_number: int) -> int:
        # A block nobody else has: a key no JSON hash id can equal.
        return self._dense(line_number, -1 - len(self.id_to_dense))

    def parse(self, line_number: int, text: str) -> TraceRequest:
        path = self.path
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceFormatError(path, line_number, None, f"not valid JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise TraceFormatError(path, line_number, None, "expected a JSON object")
        output_length = self._int(record, line_number, "output_length", 1)
        priority = self._int(record, line_number, "priority", None, default=0)
        if "hash_ids" in record:
            timestamp_ms = self._timestamp(record, line_number, required=True)
            runs, num_tokens = self._hash_id_runs(record, line_number)
            explicit = None
        elif "prompt_token_ids" in record:
            timestamp_ms = self._timestamp(record, line_number, required=False)
            explicit = self._token_ids(record, line_number)
            runs, num_tokens = (), len(explicit)
        elif "input_length" in record:
            timestamp_ms = self._timestamp(record, line_number, required=False)
            num_tokens = self._int(record, line_number, "input_length", 1)
            runs = tuple(
                (self._fresh_dense(line_number) * TRACE_BLOCK_TOKENS, size)
                for size in _block_sizes(num_tokens)
            )
            runs, explicit = _merge_runs(runs), None
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
        )

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
            or value < 0
        ):
            raise TraceFormatError(
                self.path,
                line_number,
                "timestamp",
                f"expected a finite number of milliseconds >= 0, got {value!r}",
            )
        return float(value)

    def _hash_id_runs(self, record: dict, line_number: int) -> tuple[tuple[TokenRun, ...], int]:
        num_tokens = self._int(record, line_number, "input_length", 1)
        hash_ids = record["hash_ids"]
        if not isinstance(hash_ids, list):
            raise TraceFormatError(
                self.path, line_number, "hash_ids", f"expected a list, got {hash_ids!r}"
            )
        sizes = _block_sizes(num_tokens)
        if len(hash_ids) != len(sizes):
            raise TraceFormatError(
                self.path,
                line_number,
                "hash_ids",
                f"has {len(hash_ids)} ids; input_length {num_tokens} needs "
                f"ceil({num_tokens}/{TRACE_BLOCK_TOKENS}) = {len(sizes)}",
            )
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
    returning; raises `TraceFormatError` on the first bad line. Unsorted timestamps are
    sorted with a `TraceWarning`.
    """
    path = Path(path)
    if limit is not None and limit < 1:
        raise InvalidArgumentError(f"limit must be >= 1, got {limit}")
    source = str(path)
    parser = _LineParser(source)
    requests: list[TraceRequest] = []
    with path.open(encoding="utf-8") as lines:
        for line_number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            requests.append(parser.parse(line_number, text))
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise TraceFormatError(source, 1, None, "the trace has no requests")
    ordered = assign_output_tokens(sort_by_arrival(requests, source), source)
    return Trace(name or path.name, ordered, source)
