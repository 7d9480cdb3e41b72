"""Scheduler layer, checks: a scheduler's configuration against its pool, and its invariants.

Functions of the scheduler's parts (queues, records, config, manager); they read and raise
(`ConfigError`, `InvariantViolation`), never change anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request, RequestStatus
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.output import StepRecord

_RUNNING = RequestStatus.RUNNING
_WAITING_STATES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def check_no_prefix_replay(manager: KVCacheManager) -> None:
    """The reference scheduler does not replay: with prefix caching on, a group rebuilt by
    bounded prefix replay (`ReplayedSlidingWindowSpec`) would get hits with no KV behind them."""
    if not manager.enable_caching:
        return
    for group_id, group in enumerate(manager.kv_cache_config.kv_cache_groups):
        if group.kv_cache_spec.prefix_replay_tokens:
            raise ConfigError(
                f"group {group_id} ({type(group.kv_cache_spec).__name__}) is rebuilt by "
                "bounded prefix replay, which the reference scheduler does not do: use vLLM's "
                "scheduler on the drop-in, or turn prefix caching off"
            )


def check_pool_holds_one_request(manager: KVCacheManager, max_model_len: int) -> None:
    """A request of `max_model_len` tokens must fit in an empty pool, or it could never run."""
    num_usable_blocks = manager.kv_cache_config.num_blocks - 1
    num_needed = manager.coordinator.get_num_blocks_to_allocate(
        "\x00pool-capacity-probe",
        max_model_len,
        manager.empty_kv_cache_blocks.blocks,
        0,
        0,
        apply_admission_cap=True,
    )
    if num_needed > num_usable_blocks:
        raise ConfigError(
            f"the pool's {num_usable_blocks} usable blocks cannot hold one request of "
            f"max_model_len {max_model_len} tokens ({num_needed} blocks); lower max_model_len "
            "or add blocks"
        )


def check_scheduler_state(
    running: Sequence[Request],
    waiting_queue: Iterable[Request],
    loading: Mapping[str, tuple[Request, int]],
    requests: Mapping[str, Request],
    step_records: Sequence[StepRecord],
    config: SchedulerConfig,
    manager: KVCacheManager,
    held_outside: Sequence[KVCacheBlock] = (),
) -> None:
    """Check `Scheduler`'s invariants (its docstring) over its queues, the last step's limits
    and the manager (`held_outside`: the ends of the step's block copies, released by
    `update_from_output`); raise `InvariantViolation` on the first broken one."""
    running_ids = [request.request_id for request in running]
    waiting = list(waiting_queue)
    waiting_ids = [request.request_id for request in waiting]
    if len(set(running_ids)) != len(running_ids) or len(set(waiting_ids)) != len(waiting_ids):
        raise InvariantViolation("a request appears twice in one queue")
    both = set(running_ids) & set(waiting_ids)
    if both:
        raise InvariantViolation(f"requests {sorted(both)!r} are both running and waiting")
    if set(running_ids) & set(loading) or set(waiting_ids) & set(loading):
        raise InvariantViolation("a loading request is also running or waiting")
    if set(running_ids) | set(waiting_ids) | set(loading) != set(requests):
        raise InvariantViolation("the queues do not hold exactly the unfinished requests")
    for request, _ in loading.values():
        if not any(manager_blocks for manager_blocks in manager.get_block_ids(request.request_id)):
            raise InvariantViolation(f"loading request {request.request_id!r} holds no blocks")
    if len(running) + len(loading) > config.max_num_seqs:
        raise InvariantViolation(
            f"{len(running)} running requests exceed max_num_seqs {config.max_num_seqs}"
        )
    for request in running:
        if request.status != _RUNNING:
            raise InvariantViolation(f"running request {request!r} has status {request.status}")
        if not any(manager.get_block_ids(request.request_id)):
            raise InvariantViolation(f"running request {request.request_id!r} holds no blocks")
        if not 0 <= request.num_computed_tokens <= request.num_tokens:
            raise InvariantViolation(f"{request!r}: computed tokens out of range")
    for request in waiting:
        if request.status not in _WAITING_STATES or request.num_computed_tokens:
            raise InvariantViolation(f"waiting request {request!r} is not fresh")
        if any(manager.get_block_ids(request.request_id)):
            raise InvariantViolation(f"waiting request {request.request_id!r} holds blocks")
    if step_records:
        record = step_records[-1]
        if record.num_scheduled_tokens_total > config.max_num_batched_tokens:
            raise InvariantViolation(
                f"step {record.step_index} scheduled {record.num_scheduled_tokens_total} "
                f"tokens > max_num_batched_tokens {config.max_num_batched_tokens}"
            )
        if len(record.scheduled_request_ids) > config.max_num_seqs:
            raise InvariantViolation(f"step {record.step_index} exceeds max_num_seqs")
    manager.check_invariants(held_outside)
