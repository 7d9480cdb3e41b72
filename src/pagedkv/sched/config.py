"""Scheduler layer: the scheduler's frozen configuration (validated at construction, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Limits and switches of the reference scheduler.

    `max_model_len=None` takes the manager's. `long_prefill_token_threshold > 0` caps the
    prompt tokens one request may compute in a step. `async_caching` defers prefix caching of a
    step's blocks until its output arrives (`cache_blocks` in `update_from_output`), as an
    asynchronous engine must. `reserve_full_prompt` admits a request only if its whole prompt
    fits in the free blocks (`full_sequence_must_fit`, the reference's default), so chunked
    prefills are not admitted just to be preempted. `stop_token_ids` finish a request early.
    """

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    async_caching: bool = False
    reserve_full_prompt: bool = True
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            _check_int(name, getattr(self, name), 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for token_id in self.stop_token_ids:
            _check_int("stop token id", token_id, 0)


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"SchedulerConfig.{name} must be an int >= {minimum}, got {value!r}")
