"""vLLM 0.33's KV hints (`Request.kv_hints`, a `KvHintsEnvelope`) read as pagedkv retention.

One action is understood: type `pagedkv.retention`, version `1`, payload
`{"ranges": [{"start": int, "end": int | null, "priority": 0..100, "duration_s": float |
null}], "decode_priority": 0..100 | null}`, the meaning of `pagedkv.retention.RetentionConfig`.
Anything else (another type or version, a malformed payload, hints while retention is off, a
second retention action) is skipped, counted per kind and logged once per kind; nothing here
raises into vLLM's engine loop. The counts are also Prometheus counters in the default registry
(the one vLLM's `/metrics` serves): `pagedkv:kv_hints_skipped_total{kind}` and
`pagedkv:kv_hints_applied_total`. Reads the envelope by attribute, so it imports nothing of vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from pagedkv.errors import PagedKVError
from pagedkv.retention import DEFAULT_PRIORITY, RetentionConfig, TokenRangeRetention

RETENTION_ACTION_TYPE = "pagedkv.retention"
RETENTION_ACTION_VERSION = "1"
SKIP_KINDS = ("unknown_type", "unknown_version", "malformed", "retention_off", "duplicate")

logger = logging.getLogger("pagedkv.integrations.vllm")

_COUNTERS: list[Any] = []  # [skipped (by kind), applied], created once per process


def _prometheus_counters() -> list[Any]:
    """The two Prometheus counters (none without prometheus-client, which vLLM requires)."""
    if not _COUNTERS:
        try:
            import prometheus_client
        except ImportError:  # pragma: no cover - vLLM depends on it
            _COUNTERS.extend((None, None))
            return _COUNTERS
        _COUNTERS.append(
            prometheus_client.Counter(
                "pagedkv:kv_hints_skipped",
                "KV hint actions pagedkv skipped, by kind",
                ["kind"],
            )
        )
        _COUNTERS.append(
            prometheus_client.Counter(
                "pagedkv:kv_hints_applied", "pagedkv.retention KV hint actions applied"
            )
        )
    return _COUNTERS


class MalformedHint(ValueError):
    """A retention payload that does not follow the schema (the message says where)."""


def _int(value: object, where: str, low: int, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise MalformedHint(f"{where}={value!r} must be an int {bound}")
    return value


def _duration(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise MalformedHint(f"{where}={value!r} must be a number of seconds > 0 or null")
    return float(value)


def parse_retention_payload(payload: object) -> RetentionConfig:
    """The `RetentionConfig` of a `pagedkv.retention` v1 payload; `MalformedHint` if it is not
    one."""
    if not isinstance(payload, dict):
        raise MalformedHint(f"payload must be an object, got {type(payload).__name__}")
    unknown = [key for key in payload if key not in ("ranges", "decode_priority")]
    if unknown:
        raise MalformedHint(f"unknown payload key {unknown[0]!r}")
    ranges = payload.get("ranges", [])
    if not isinstance(ranges, list):
        raise MalformedHint("ranges must be a list")
    token_ranges = []
    for index, item in enumerate(ranges):
        where = f"ranges[{index}]"
        if not isinstance(item, dict) or set(item) - {"start", "end", "priority", "duration_s"}:
            raise MalformedHint(f"{where} must be an object with start, end, priority, duration_s")
        if "start" not in item or "priority" not in item:
            raise MalformedHint(f"{where} needs start and priority")
        start = _int(item["start"], f"{where}.start", 0)
        end = item.get("end")
        if end is not None:
            end = _int(end, f"{where}.end", start + 1)
        priority = _int(item["priority"], f"{where}.priority", 0, 100)
        duration_s = _duration(item.get("duration_s"), f"{where}.duration_s")
        token_ranges.append(TokenRangeRetention(start, end, priority, duration_s))
    decode = payload.get("decode_priority")
    decode_priority = (
        DEFAULT_PRIORITY if decode is None else _int(decode, "decode_priority", 0, 100)
    )
    try:
        return RetentionConfig(tuple(token_ranges), decode_priority)
    except PagedKVError as exc:  # overlapping ranges
        raise MalformedHint(str(exc)) from None


class KvHintReader:
    """Turns a request's KV hints into pagedkv retention, counting what it skips.

    `num_skipped[kind]` counts skipped actions (or envelopes) per kind of `SKIP_KINDS`;
    `num_applied` counts retention actions applied. Each kind is logged once.
    """

    def __init__(self, retention_enabled: bool) -> None:
        self.retention_enabled = retention_enabled
        self.num_applied = 0
        self.num_skipped = dict.fromkeys(SKIP_KINDS, 0)
        self._logged: set[str] = set()
        self._skipped_counter, self._applied_counter = _prometheus_counters()

    def _skip(self, kind: str, detail: str) -> None:
        self.num_skipped[kind] += 1
        if self._skipped_counter is not None:
            self._skipped_counter.labels(kind=kind).inc()
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning(
                "pagedkv: skipped a KV hint (%s: %s); further ones of this kind are only counted",
                kind,
                detail,
            )

    def retention_for(self, envelope: Any) -> RetentionConfig | None:
        """The retention the envelope asks for, or None (no usable retention action)."""
        try:
            return self._read(envelope)
        except Exception as exc:  # never into vLLM's engine loop
            self._skip("malformed", f"unreadable envelope ({type(exc).__name__}: {exc})")
            return None

    def _read(self, envelope: Any) -> RetentionConfig | None:
        found: RetentionConfig | None = None
        for action in envelope.actions:
            action_type = action.action_type
            if action_type != RETENTION_ACTION_TYPE:
                self._skip("unknown_type", f"action type {action_type!r}")
                continue
            if action.action_version != RETENTION_ACTION_VERSION:
                self._skip(
                    "unknown_version",
                    f"{RETENTION_ACTION_TYPE} version {action.action_version!r}; this pagedkv "
                    f"reads version {RETENTION_ACTION_VERSION!r}",
                )
                continue
            try:
                config = parse_retention_payload(action.payload)
            except MalformedHint as exc:
                self._skip("malformed", f"action {action.action_id!r}: {exc}")
                continue
            if not self.retention_enabled:
                self._skip(
                    "retention_off",
                    'retention is off; start vLLM with --additional-config \'{"pagedkv": '
                    '{"retention": true}}\'',
                )
                continue
            if found is not None:
                self._skip("duplicate", f"a second {RETENTION_ACTION_TYPE} action; the first wins")
                continue
            found = config
            self.num_applied += 1
            if self._applied_counter is not None:
                self._applied_counter.inc()
        return found
