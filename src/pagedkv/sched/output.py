"""Scheduler layer: what one `schedule()` call returns and what each step leaves on record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedkv.block import KVCacheBlock
from pagedkv.kv_cache_blocks import KVCacheBlockCopy
from pagedkv.request import Request


class ScheduledRequest:
    """One request in a step's batch.

    `num_computed_tokens` is the count before this step; the step computes tokens
    `[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)`.
    `is_prefill_chunk_complete` is True when, after this step, every token the request has so
    far is computed, so the step samples a token for it: the last prefill chunk and every
    decode step (for a request resumed after preemption, "prompt" means its prompt plus the
    outputs it had already generated).

    `block_ids` (the whole table per group) and `new_block_ids` (blocks allocated in this step,
    prefix hits excluded) are built on first read from the manager's tables as they were at
    scheduling time; read them before the next `schedule()`.
    """

    __slots__ = (
        "request",
        "num_computed_tokens",
        "num_scheduled_tokens",
        "is_prefill_chunk_complete",
        "_tables",
        "_num_blocks",
        "_new_blocks",
        "_block_ids",
    )

    def __init__(
        self,
        request: Request,
        num_computed_tokens: int,
        num_scheduled_tokens: int,
        tables: tuple[list[KVCacheBlock], ...],
        new_blocks: tuple[Sequence[KVCacheBlock], ...],
    ) -> None:
        self.request = request
        self.num_computed_tokens = num_computed_tokens
        self.num_scheduled_tokens = num_scheduled_tokens
        self.is_prefill_chunk_complete = (
            num_computed_tokens + num_scheduled_tokens >= request.num_tokens
        )
        # Hot path: keep the live tables and their lengths; ids are built only if read.
        self._tables = tables
        self._num_blocks = tuple(map(len, tables))
        self._new_blocks = new_blocks
        self._block_ids: tuple[list[int], ...] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        if self._block_ids is None:
            self._block_ids = tuple(
                [block.block_id for block in table[:num_blocks]]
                for table, num_blocks in zip(self._tables, self._num_blocks, strict=True)
            )
        return self._block_ids

    @property
    def new_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in blocks] for blocks in self._new_blocks)

    def __repr__(self) -> str:
        return (
            f"ScheduledRequest({self.request.request_id!r}, "
            f"num_computed_tokens={self.num_computed_tokens}, "
            f"num_scheduled_tokens={self.num_scheduled_tokens})"
        )


@dataclass(slots=True)
class SchedulerOutput:
    """One step's batch, in batch order (running requests first, then new admissions)."""

    step_index: int
    scheduled: list[ScheduledRequest]
    preempted_request_ids: list[str]
    num_scheduled_tokens_total: int
    # (request id, tokens) of loads from the host-memory tier started this step: the request
    # waits (holding its blocks) until the caller reports the load done (`complete_kv_loads`).
    kv_loads_started: list[tuple[str, int]] = field(default_factory=list)
    # Block copies to run before the step's forward (hits ending inside a block; vLLM 0.33's
    # `kv_cache_block_copies`): each `src_block_id`'s KV into its `dst_block_id`.
    kv_cache_block_copies: list[KVCacheBlockCopy] = field(default_factory=list)


@dataclass(slots=True)
class StepRecord:
    """What happened in one step (filled by `schedule()`; `finished_request_ids` by
    `update_from_output()`).

    A decode token is the single token of a request past its prompt; every other scheduled
    token is a prefill token (recomputation after preemption included).
    `num_kv_tokens_read` sums, over the batch, the context each request attends to (its
    computed tokens plus the tokens of this step). `num_prefill_attention_pairs` counts the
    causal query-key pairs of the prefill tokens (a token at position p attends to p + 1
    keys), the part of attention compute that grows with context. `usage` is the pool usage
    after allocation; `num_running` and `num_waiting` are the queue lengths after scheduling.
    """

    step_index: int
    scheduled_request_ids: tuple[str, ...]
    num_scheduled_tokens: tuple[int, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    num_kv_tokens_read: int
    num_prefill_attention_pairs: int
    num_admitted: int
    num_prefix_hit_tokens: int
    preempted_request_ids: tuple[str, ...]
    usage: float
    num_running: int
    num_waiting: int
    finished_request_ids: tuple[str, ...] = field(default=())

    @property
    def num_scheduled_tokens_total(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens
