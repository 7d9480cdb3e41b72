"""Leaf: per-request KV-cache retention hints, after TensorRT-LLM's `KvCacheRetentionConfig`.

A hint gives token ranges of the prompt a retention priority (0 lowest .. 100 highest, 35 the
default) and optionally a duration; blocks generated after the prompt take the decode priority.
Plain data: the eviction layer (`pagedkv.eviction.retention_levels`) applies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError, InvalidTypeError

MIN_PRIORITY = 0
MAX_PRIORITY = 100
DEFAULT_PRIORITY = 35
"""Blocks without a hint, and hinted blocks whose duration lapsed, have this priority."""


def _check_priority(name: str, priority: object) -> None:
    if type(priority) is not int or not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise InvalidArgumentError(
            f"{name}={priority!r}: a retention priority is an int in "
            f"[{MIN_PRIORITY}, {MAX_PRIORITY}]"
        )


def _check_duration(name: str, duration_s: object) -> None:
    if duration_s is None:
        return
    if (
        isinstance(duration_s, bool)
        or not isinstance(duration_s, (int, float))
        or not math.isfinite(duration_s)
        or duration_s <= 0
    ):
        raise InvalidArgumentError(
            f"{name}={duration_s!r}: a retention duration is a finite number of seconds > 0, "
            "or None (never lapses)"
        )


@dataclass(frozen=True, slots=True)
class TokenRangeRetention:
    """Priority for prompt tokens `[token_start, token_end)` (`token_end=None`: to the end).

    `duration_s`: the priority lapses to the default this long after the block's last use
    (None: never).
    """

    token_start: int
    token_end: int | None
    priority: int
    duration_s: float | None = None

    def __post_init__(self) -> None:
        if type(self.token_start) is not int or self.token_start < 0:
            raise InvalidArgumentError(f"token_start={self.token_start!r} must be an int >= 0")
        if self.token_end is not None and (
            type(self.token_end) is not int or self.token_end <= self.token_start
        ):
            raise InvalidArgumentError(
                f"token_end={self.token_end!r} must be an int > token_start "
                f"({self.token_start}) or None"
            )
        _check_priority("priority", self.priority)
        _check_duration("duration_s", self.duration_s)


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    """A request's retention hints: prompt token ranges, and a priority for decode blocks.

    Ranges may not overlap. A block takes the highest priority of the tokens it holds (prompt
    tokens outside every range count at the default); a block reaching past the prompt also
    counts the decode priority. Its duration is that of the range giving the priority.
    """

    token_ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.token_ranges, tuple) or not all(
            isinstance(r, TokenRangeRetention) for r in self.token_ranges
        ):
            raise InvalidTypeError(
                f"token_ranges must be a tuple of TokenRangeRetention, got {self.token_ranges!r}"
            )
        _check_priority("decode_priority", self.decode_priority)
        _check_duration("decode_duration_s", self.decode_duration_s)
        ordered = sorted(self.token_ranges, key=lambda r: r.token_start)
        for before, after in zip(ordered, ordered[1:], strict=False):
            if before.token_end is None or before.token_end > after.token_start:
                raise InvalidArgumentError(
                    f"retention token ranges overlap: [{before.token_start}, "
                    f"{before.token_end}) and [{after.token_start}, {after.token_end})"
                )

    def block_priority(
        self, start_token: int, end_token: int, num_prompt_tokens: int
    ) -> tuple[int, float | None]:
        """(priority, duration_s) of the block holding tokens `[start_token, end_token)`."""
        best: tuple[int, float | None] | None = None
        num_uncovered = min(end_token, num_prompt_tokens) - start_token
        for token_range in self.token_ranges:
            range_end = (
                num_prompt_tokens if token_range.token_end is None else token_range.token_end
            )
            overlap = min(end_token, range_end, num_prompt_tokens) - max(
                start_token, token_range.token_start
            )
            if overlap > 0:
                num_uncovered -= overlap
                best = _higher(best, token_range.priority, token_range.duration_s)
        if num_uncovered > 0:
            # Prompt tokens of the block outside every range count at the default.
            best = _higher(best, DEFAULT_PRIORITY, None)
        if end_token > num_prompt_tokens:
            best = _higher(best, self.decode_priority, self.decode_duration_s)
        return best if best is not None else (DEFAULT_PRIORITY, None)


def _higher(
    best: tuple[int, float | None] | None, priority: int, duration_s: float | None
) -> tuple[int, float | None]:
    """The higher priority; on a tie the longer duration (None, never lapsing, is longest)."""
    if best is None or priority > best[0]:
        return priority, duration_s
    if priority == best[0] and best[1] is not None:
        if duration_s is None or duration_s > best[1]:
            return priority, duration_s
    return best
