"""Scheduler layer: the reference scheduler, the caller the KV-cache manager was designed for.

Waiting and running queues, a per-step token budget, chunked prefill, prefix-cache lookups on
admission, preemption by recompute and finishing on output length. The policy (queue order,
victim) is an injected object. Knows nothing of models, tensors or time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedkv.block import KVCacheBlock
from pagedkv.errors import (
    ConfigError,
    InvalidArgumentError,
    InvalidTypeError,
    RequestStateError,
)
from pagedkv.kv_cache_blocks import ComputedBlocks
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.managers import FullAttentionManager
from pagedkv.owner_thread import OwnerThread
from pagedkv.request import Request, RequestStatus
from pagedkv.sched.checks import (
    check_no_prefix_replay,
    check_pool_holds_one_request,
    check_scheduler_state,
)
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput, StepRecord
from pagedkv.sched.policy import FCFSPolicy, SchedulingPolicy
from pagedkv.sched.records import make_step_record
from pagedkv.sched.sampling import append_sampled, validate_sampled

_RUNNING = RequestStatus.RUNNING


class Scheduler:
    """Drives one `KVCacheManager` step by step.

    Usage alternates `schedule()` and `update_from_output()`; a request is sampled only in
    the step its prompt completes and in every decode step after.

    Invariants (`check_invariants`): every unfinished request is in exactly one of `running`
    (status RUNNING, holding blocks), `waiting` (WAITING or PREEMPTED, no computed tokens,
    no blocks) and `loading` (its prefix is being loaded from the manager's host-memory tier:
    it holds blocks, as vLLM's WAITING_FOR_REMOTE_KVS); `len(running) + len(loading) <=
    max_num_seqs`; each step schedules at most `max_num_batched_tokens` tokens and at most
    `max_num_seqs` requests.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        config: SchedulerConfig | None = None,
        policy: SchedulingPolicy | None = None,
        *,
        batched_decode: bool = True,
    ) -> None:
        """`batched_decode=False` gives decoding requests their slots one `allocate_slots` call
        at a time, the reference that the batched path (one full-attention group only) equals.
        """
        if not isinstance(kv_cache_manager, KVCacheManager):
            raise ConfigError(
                f"kv_cache_manager must be a KVCacheManager, got {kv_cache_manager!r}"
            )
        config = SchedulerConfig() if config is None else config
        if not isinstance(config, SchedulerConfig):
            raise ConfigError(f"config must be a SchedulerConfig, got {config!r}")
        max_model_len = config.max_model_len or kv_cache_manager.max_model_len
        if max_model_len > kv_cache_manager.max_model_len:
            raise ConfigError(
                f"SchedulerConfig.max_model_len {max_model_len} exceeds the manager's "
                f"max_model_len {kv_cache_manager.max_model_len}"
            )
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"without chunked prefill, max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})"
            )
        check_no_prefix_replay(kv_cache_manager)
        check_pool_holds_one_request(kv_cache_manager, max_model_len)
        self.kv_cache_manager = kv_cache_manager
        self.config = config
        self.policy: SchedulingPolicy = FCFSPolicy() if policy is None else policy
        self.max_model_len = max_model_len
        self.waiting = self.policy.make_waiting_queue()
        self.running: list[Request] = []
        # Requests waiting for a host-tier load: id -> (request, computed tokens once loaded).
        self.loading: dict[str, tuple[Request, int]] = {}
        self._host_tier = kv_cache_manager.block_pool.host_tier is not None
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # Hot path: each running request's live block tables (the manager's own lists, which
        # grow in place until the request is freed), fetched once instead of every step.
        self._tables: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        managers = kv_cache_manager.coordinator.single_type_managers
        # Decodes in one manager call: one full-attention group, blocks cached as they fill.
        self._batched_decode = (
            batched_decode
            and not config.async_caching
            and len(managers) == 1
            and type(managers[0]) is FullAttentionManager
        )
        self.step_records: list[StepRecord] = []
        self._stop_token_ids = frozenset(config.stop_token_ids)
        self._pending: SchedulerOutput | None = None
        # The ends of the pending step's block copies (sub-block hits): held until it ran.
        self._copy_retained: list[KVCacheBlock] = []
        self._kv_loads_started: list[tuple[str, int]] = []
        self._next_step_index = 0
        # The one thread that may change the scheduler (docs/design.md, "Threads").
        self.owner_thread = OwnerThread("this Scheduler", "release_owner_thread()")

    # ------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        """Queue a new request; `request.max_tokens` is the output length to generate."""
        self.owner_thread.check("Scheduler.add_request")
        if not isinstance(request, Request):
            raise InvalidTypeError(f"expected a pagedkv Request, got {type(request).__name__}")
        request_id = request.request_id
        if request_id in self.requests:
            raise RequestStateError(f"request id {request_id!r} is already scheduled")
        if request.status != RequestStatus.WAITING or request.num_computed_tokens:
            raise RequestStateError(
                f"request {request_id!r} is {request.status.name} with "
                f"{request.num_computed_tokens} computed tokens; add only new requests"
            )
        if request.num_tokens >= self.max_model_len:
            raise InvalidArgumentError(
                f"request {request_id!r}: {request.num_tokens} prompt tokens leave no room for "
                f"an output token within max_model_len {self.max_model_len}"
            )
        if request.max_tokens == 0:
            raise InvalidArgumentError(f"request {request_id!r}: max_tokens must be >= 1, got 0")
        manager = self.kv_cache_manager
        if manager.enable_caching:
            hasher = request.block_hasher
            if hasher is None or hasher.hash_block_size != manager.hash_block_size:
                raise RequestStateError(
                    f"request {request_id!r} needs a block hasher of "
                    f"{manager.hash_block_size}-token blocks (prefix caching is on); build it "
                    "with block_hasher=make_request_block_hasher(...)"
                )
        self.waiting.add(request)
        self.requests[request_id] = request
        # Once per entry into the queue (the look-ahead and session policies; else a no-op).
        manager.add_waiting(request)

    def abort_request(self, request_id: str) -> bool:
        """Finish an unfinished request as aborted and free its blocks; False if unknown."""
        self.owner_thread.check("Scheduler.abort_request")
        request = self.requests.pop(request_id, None)
        if request is None:
            return False
        if request_id in self.loading:
            del self.loading[request_id]
        elif request.status == _RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED_ABORTED
        self.kv_cache_manager.free(request)
        self._tables.pop(request_id, None)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch: running requests first, then admissions (none in a step
        that preempted). Every scheduled request holds slots for its new tokens on return."""
        self.owner_thread.check("Scheduler.schedule")
        if self._pending is not None:
            raise RequestStateError(
                f"schedule() called before update_from_output() of step {self._pending.step_index}"
            )
        manager = self.kv_cache_manager
        manager.new_step_starts()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        self._kv_loads_started = []
        budget = self._schedule_running(scheduled, preempted, budget)
        num_admitted = num_hit_tokens = 0
        if not preempted:
            num_admitted, num_hit_tokens, budget = self._schedule_waiting(scheduled, budget)
        # Hits that end inside a block: the worker copies their shared blocks before the step.
        copies, self._copy_retained = manager.take_kv_cache_block_copies()
        output = SchedulerOutput(
            self._next_step_index,
            scheduled,
            preempted,
            self.config.max_num_batched_tokens - budget,
            self._kv_loads_started,
            copies,
        )
        record = make_step_record(
            output,
            num_admitted,
            num_hit_tokens,
            manager.usage,
            len(self.running),
            len(self.waiting),
        )
        self.step_records.append(record)
        self._next_step_index += 1
        self._pending = output
        return output

    def _schedule_running(
        self, scheduled: list[ScheduledRequest], preempted: list[str], budget: int
    ) -> int:
        manager = self.kv_cache_manager
        running = self.running
        threshold = self.config.long_prefill_token_threshold
        max_model_len = self.max_model_len
        delay_cache = self.config.async_caching
        index = self._schedule_decodes(scheduled, budget) if self._batched_decode else 0
        budget -= index
        while index < len(running) and budget > 0:
            request = running[index]
            num_computed = request.num_computed_tokens
            num_new = request.num_tokens - num_computed
            if threshold and num_new > threshold:
                num_new = threshold
            num_new = min(num_new, budget, max_model_len - num_computed)
            if num_new <= 0:
                index += 1
                continue
            while True:
                new_blocks = manager.allocate_slots(
                    request, num_new, delay_cache_blocks=delay_cache
                )
                if new_blocks is not None:
                    break
                victim = self.policy.select_victim(running)
                victim_index = running.index(victim)
                del running[victim_index]
                if victim_index < index:
                    # Already scheduled in this step: give its tokens back.
                    index -= 1
                    for position, item in enumerate(scheduled):
                        if item.request is victim:
                            budget += item.num_scheduled_tokens
                            del scheduled[position]
                            break
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                # The request was the victim itself (it left `running`, so `index` already
                # names the next one). As vLLM's scheduler: the requests after it rank above
                # it under the priority policy and may fit in what it freed; under FCFS it
                # was the last one, so the pass ends here.
                continue
            tables = self._tables.get(request.request_id) or self._live_tables(request)
            scheduled.append(
                ScheduledRequest(request, num_computed, num_new, tables, new_blocks.blocks)
            )
            budget -= num_new
            index += 1
        return budget

    def _schedule_decodes(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        """Schedule the leading running requests that each decode one token, in one
        `allocate_decode_slots` call (the same as `allocate_slots(request, 1)` for each, in
        order, up to the first that does not fit); return how many got their slot.

        Only with one full-attention group, where a decode's new block (at most one) is the
        last of its table.
        """
        running = self.running
        max_model_len = self.max_model_len
        limit = min(len(running), budget)
        count = 0
        while count < limit:
            request = running[count]
            num_computed = request.num_computed_tokens
            if request.num_tokens - num_computed != 1 or num_computed >= max_model_len:
                break
            count += 1
        if count == 0:
            return 0
        batch = running[:count]
        num_allocated, with_new_blocks = self.kv_cache_manager.allocate_decode_slots(batch)
        no_new_blocks = self.kv_cache_manager.empty_kv_cache_blocks.blocks
        with_new = iter(with_new_blocks)
        next_with_new = next(with_new, None)
        tables_of = self._tables
        # Hot path: one ScheduledRequest per decoding request, nothing else.
        for request in batch[:num_allocated]:
            tables = tables_of.get(request.request_id) or self._live_tables(request)
            if request is next_with_new:
                new_blocks: tuple = (tables[0][-1:],)
                next_with_new = next(with_new, None)
            else:
                new_blocks = no_new_blocks
            scheduled.append(
                ScheduledRequest(request, request.num_computed_tokens, 1, tables, new_blocks)
            )
        return num_allocated

    def _schedule_waiting(
        self, scheduled: list[ScheduledRequest], budget: int
    ) -> tuple[int, int, int]:
        manager = self.kv_cache_manager
        config = self.config
        waiting = self.waiting
        running = self.running
        threshold = config.long_prefill_token_threshold
        num_admitted = num_hit_tokens = 0
        loading = self.loading
        while len(waiting) and budget > 0 and len(running) + len(loading) < config.max_num_seqs:
            request = waiting.peek()
            hit = manager.get_computed_blocks(request)
            num_hit = hit.num_computed_tokens
            # As vLLM's scheduler: sparse retention keeps the cached state at this junction.
            request.shared_prefix_boundary = hit.shared_prefix_boundary
            if self._host_tier:
                num_host = manager.get_num_host_hit_tokens(request, num_hit)
                if num_host:
                    if not self._start_host_load(request, hit, num_host, scheduled):
                        break
                    continue
            num_new = request.num_tokens - num_hit
            if threshold and num_new > threshold:
                num_new = threshold
            if not config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            new_blocks = manager.allocate_slots(
                request,
                num_new,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit.blocks,
                delay_cache_blocks=config.async_caching,
                full_sequence_must_fit=config.reserve_full_prompt,
                has_scheduled_reqs=bool(running),
            )
            if new_blocks is None:
                break
            waiting.pop()
            manager.record_prefix_cache_stats(request, num_hit)
            request.status = _RUNNING
            request.num_computed_tokens = num_hit
            running.append(request)
            tables = self._live_tables(request)
            scheduled.append(ScheduledRequest(request, num_hit, num_new, tables, new_blocks.blocks))
            budget -= num_new
            num_admitted += 1
            num_hit_tokens += num_hit
        return num_admitted, num_hit_tokens, budget

    def _start_host_load(
        self, request: Request, hit: ComputedBlocks, num_host: int, scheduled: list
    ) -> bool:
        """Admit a request whose prefix continues in the host tier: allocate blocks for the
        device hit and the host blocks (no compute this step) and start the load."""
        manager = self.kv_cache_manager
        num_hit = hit.num_computed_tokens
        new_blocks = manager.allocate_slots(
            request,
            0,
            num_new_computed_tokens=num_hit,
            new_computed_blocks=hit.blocks,
            num_external_computed_tokens=num_host,
            delay_cache_blocks=True,  # cached once loaded, as vLLM does
            full_sequence_must_fit=self.config.reserve_full_prompt,
            has_scheduled_reqs=bool(self.running or scheduled),
        )
        if new_blocks is None:
            return False
        self.waiting.pop()
        manager.load_from_host(request, num_hit, num_host)
        manager.record_prefix_cache_stats(request, num_hit)
        self.loading[request.request_id] = (request, num_hit + num_host)
        self._kv_loads_started.append((request.request_id, num_host))
        return True

    def complete_kv_loads(self, request_ids: Sequence[str]) -> None:
        """The host-tier loads of these requests are done: cache the loaded blocks and run
        them (their prefill continues from the loaded tokens in the next step)."""
        self.owner_thread.check("Scheduler.complete_kv_loads")
        for request_id in request_ids:
            entry = self.loading.pop(request_id, None)
            if entry is None:
                raise RequestStateError(f"request {request_id!r} has no KV load in flight")
            request, num_computed = entry
            request.num_computed_tokens = num_computed
            self.kv_cache_manager.cache_blocks(request, num_computed)
            request.status = _RUNNING
            self.running.append(request)

    def _live_tables(self, request: Request) -> tuple[list[KVCacheBlock], ...]:
        """The request's block tables per group, kept for the next steps when every group has
        its own table (an empty one could be a placeholder the manager replaces later)."""
        tables = self.kv_cache_manager.coordinator.get_blocks(request.request_id)
        if all(tables):
            self._tables[request.request_id] = tables
        return tables

    def _preempt(self, request: Request) -> None:
        """Preempt by recompute: free every block; the cached prefix usually survives."""
        self._tables.pop(request.request_id, None)
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.waiting.prepend(request)
        self.kv_cache_manager.add_waiting(request)

    # ------------------------------------------------------------------ outputs

    def update_from_output(
        self, output: SchedulerOutput, sampled_token_ids: Mapping[str, Sequence[int]]
    ) -> list[Request]:
        """Apply a step's results: advance computed tokens, append sampled tokens, finish and
        free requests that reached `max_tokens`, a stop token or `max_model_len`.

        `sampled_token_ids` must hold a non-empty list exactly for the scheduled requests
        whose `is_prefill_chunk_complete` is True (aborted ones may be left out). Nothing
        changes if it does not.

        Returns:
            The requests finished by this step, in batch order.
        """
        self.owner_thread.check("Scheduler.update_from_output")
        if output is not self._pending:
            raise RequestStateError(f"step {output.step_index} is not the step awaiting its output")
        live = validate_sampled(output, sampled_token_ids, self.requests)
        manager = self.kv_cache_manager
        if self._copy_retained:
            # The step ran, its copies with it: their ends may be reused now.
            manager.block_pool.free_blocks(self._copy_retained)
            self._copy_retained = []
        async_caching = self.config.async_caching and manager.enable_caching
        one_token_fast = not self._stop_token_ids
        max_model_len = self.max_model_len
        finished: list[Request] = []
        for item in live:
            request = item.request
            request.num_computed_tokens = item.num_computed_tokens + item.num_scheduled_tokens
            if async_caching:
                manager.cache_blocks(request, request.num_computed_tokens)
            if item.is_prefill_chunk_complete:
                tokens = sampled_token_ids[request.request_id]
                if one_token_fast and len(tokens) == 1:
                    # Hot path: `_append_sampled` for one token and no stop ids: finished
                    # once the request reaches max_model_len or max_tokens.
                    request.append_output_token_ids(tokens[0])
                    max_tokens = request.max_tokens
                    if request.num_tokens < max_model_len and (
                        max_tokens is None
                        or request.num_tokens - request.num_prompt_tokens < max_tokens
                    ):
                        continue
                    status: RequestStatus | None = RequestStatus.FINISHED_LENGTH_CAPPED
                else:
                    status = append_sampled(request, tokens, self._stop_token_ids, max_model_len)
                if status is not None:
                    request.status = status
                    manager.free(request)
                    del self.requests[request.request_id]
                    self._tables.pop(request.request_id, None)
                    finished.append(request)
        if finished:
            self.running[:] = [request for request in self.running if request.status == _RUNNING]
            self.step_records[-1].finished_request_ids = tuple(
                [request.request_id for request in finished]
            )
        self._pending = None
        return finished

    # ------------------------------------------------------------------ checks

    # ------------------------------------------------------------------ checks

    def release_owner_thread(self) -> None:
        """Hand the scheduler and its manager over: the next thread that changes them owns
        them. Call it from the owner thread (see `KVCacheManager.release_owner_thread`)."""
        self.owner_thread.release()
        self.kv_cache_manager.release_owner_thread()

    def check_invariants(self) -> None:
        """Check the queues, the last step's limits and the manager."""
        check_scheduler_state(
            self.running,
            self.waiting,
            self.loading,
            self.requests,
            self.step_records,
            self.config,
            self.kv_cache_manager,
            self._copy_retained,
        )
