"""Facade layer: the scheduler-facing KV-cache manager (the reference's `KVCacheManager` API).

Validates every argument before touching state (`checks`), applies the watermark and admission
gates, and drives the coordinator; reads, stats, events (annotated through `events`), the
host-tier methods and keys-only replay are its thin rest. Knows nothing of scheduling policy.
"""

from __future__ import annotations

from _thread import get_ident
from collections.abc import Iterable, Sequence

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockResidencyObserver
from pagedkv.coordinators import make_coordinator, make_running_allocator
from pagedkv.errors import (
    ConfigError,
    InvalidArgumentError,
    InvariantViolation,
    RequestStateError,
)
from pagedkv.events import KVCacheEvent
from pagedkv.eviction import EvictionConfig, EvictionStats, as_eviction_config
from pagedkv.kv_cache_blocks import ComputedBlocks, DecodeSlots, KVCacheBlockCopy, KVCacheBlocks
from pagedkv.kv_cache_manager.checks import (
    AllocationChecker,
    check_count,
    check_host_tier_layout,
    check_manager_config,
)
from pagedkv.kv_cache_manager.events import annotate_block_stored, event_metadata
from pagedkv.managers import FullAttentionManager
from pagedkv.request import Request, RequestStatus
from pagedkv.specs import KVCacheConfig, SpecDecodeConfig
from pagedkv.stats import PrefixCacheStats


class KVCacheManager:
    """Paged KV-cache blocks for a scheduler, with prefix caching.

    Contracts: `get_computed_blocks` changes nothing; `allocate_slots` validates and counts
    first and changes nothing unless the whole allocation fits (the window frees of stage 7
    aside); it returns only the newly allocated blocks, or None.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int | None = None,
        hash_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockResidencyObserver | None = None,
        watermark: float = 0.0,
        eviction: EvictionConfig | str | None = None,
        *,
        use_eagle: bool = False,
        num_prefill_lookahead: int = 0,
        num_hash_lookahead_tokens: int = 0,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> None:
        """Args (beyond the reference's first ten, which keep their order):
        eviction: the eviction policy (a name from `pagedkv.eviction.EVICTION_POLICY_NAMES`) or an
            `EvictionConfig` with retention and a host-memory tier; default plain LRU.
        use_eagle, num_prefill_lookahead, num_hash_lookahead_tokens: see `SpecDecodeConfig`.
        dcp_world_size, pcp_world_size: context parallelism as vLLM 0.33 accounts it: a block
            of a group `dcp_sharded` across `dcp_world_size` ranks covers `block_size *
            dcp_world_size` tokens (`kv_cache_config` then holds the scaled specs; Mamba states
            are replicated and keep theirs); prefill context parallelism needs full-attention
            (or replicated) groups and changes no block size.
        """
        spec_decode = SpecDecodeConfig(
            bool(use_eagle), num_prefill_lookahead, num_hash_lookahead_tokens
        )
        kv_cache_config, scheduler_block_size, hash_block_size = check_manager_config(
            kv_cache_config,
            max_model_len,
            scheduler_block_size,
            hash_block_size,
            max_in_flight_tokens,
            enable_caching,
            watermark,
            spec_decode,
            dcp_world_size,
            pcp_world_size,
        )
        groups = kv_cache_config.kv_cache_groups
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.max_in_flight_tokens = max_in_flight_tokens or max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.log_stats = log_stats
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        self.num_kv_cache_groups = len(groups)
        self.watermark = watermark
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        self.coordinator = make_coordinator(
            kv_cache_config,
            max_model_len,
            hash_block_size,
            enable_caching,
            enable_kv_cache_events,
            self.max_in_flight_tokens,
            metrics_collector,
            scheduler_block_size,
            eviction=as_eviction_config(eviction),
            spec_decode=spec_decode,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
        )
        self.spec_decode = spec_decode
        self.use_eagle = spec_decode.use_eagle
        self.block_pool = self.coordinator.block_pool
        # One owner thread for the manager and its pool (docs/design.md, "Threads").
        self.owner_thread = self.block_pool.owner_thread
        policy = self.block_pool.eviction_policy
        self._retention = policy.retention if policy is not None else None
        # The policy when it takes request signals (look-ahead, sessions), else None: with
        # plain LRU `add_waiting` does nothing and `free` pays one test.
        self._signals = (
            policy
            if policy is not None and (policy.lookahead is not None or policy.uses_requests)
            else None
        )
        check_host_tier_layout(self.block_pool, self.coordinator.single_type_managers)
        self.kv_cache_event_metadata = event_metadata(groups)
        # Shared immutable results; callers may test them with `is`.
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in groups))
        # Live requests (holding blocks) by id, to reject a reused id.
        self._requests: dict[str, Request] = {}
        self._empty_computed = ComputedBlocks(self.empty_kv_cache_blocks, 0, 0)
        self._checker = AllocationChecker(
            self._requests,
            self.coordinator.single_type_managers,
            self.block_pool,
            max_model_len,
            # No groups (an attention-free model, accepted as the reference accepts it): nothing
            # is ever hashed or cached, so a request's hasher is neither needed nor checked.
            enable_caching and bool(groups),
            hash_block_size,
            self.empty_kv_cache_blocks,
        )
        self._empty_hits = self._checker.empty_hits
        # Hot path: with one full-attention group (the common case), lookups skip the
        # coordinator and go straight to that group's hash map.
        managers = self.coordinator.single_type_managers
        self._fast_manager = None
        self._fast_hit_map = None
        if (
            len(managers) == 1
            and type(managers[0]) is FullAttentionManager
            and managers[0].new_block_ids is None  # no zeroing record
            and self.coordinator.num_reprefillable_tokens == 0
        ):
            self._fast_manager = managers[0]
            if enable_caching and not managers[0].use_eagle:
                self._fast_hit_map = self.block_pool.hash_to_block[0]
        # Hot path: a running request's next tokens (decode, next chunk) in one pass over the
        # groups; None where the configuration needs the general path.
        self._running_allocator = make_running_allocator(
            self.coordinator, self.empty_kv_cache_blocks
        )

    def set_retention_interval(self, interval: int | None) -> None:
        """Change the sparse-retention interval for what is cached from now on (see
        `KVCacheCoordinator.set_retention_interval`; a refused value changes nothing). The
        running requests' fast path is chosen again: an interval can rule it out."""
        self.owner_thread.check("KVCacheManager.set_retention_interval")
        self.coordinator.set_retention_interval(interval)
        self._running_allocator = make_running_allocator(
            self.coordinator, self.empty_kv_cache_blocks
        )

    def accept_uncached_free_hits(self, accept: bool) -> None:
        """Whether `allocate_slots` takes uncached free blocks of this pool as hit blocks.

        Off by default: a hit block must be cached under the request's hash (a stale or foreign
        lookup result raises `ForeignBlockError`). vLLM's manager adopts whatever free blocks
        its caller names (a connector's own hit); its drop-in turns this on. Such a block is
        held like any hit and never entered into the cache for the request.
        """
        if not isinstance(accept, bool):
            raise InvalidArgumentError(f"accept must be a bool, got {accept!r}")
        self._checker.accept_uncached_free_hits = accept

    # ------------------------------------------------------------------ lookups

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> ComputedBlocks:
        """The longest cached prefix of the request; changes nothing.

        The hit is at most `max_cache_hit_length` tokens, by default `num_tokens - 1` (one token
        is always left to compute, so the model produces logits).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self._empty_computed
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        else:
            check_count("max_cache_hit_length", max_cache_hit_length)
        hit_map = self._fast_hit_map
        if hit_map is not None:
            # Hot path: one dict probe per block; chained hashes make the first miss final.
            # (`_fast_hit_map` is only set together with `_fast_manager`.)
            block_size = self._fast_manager.block_size  # type: ignore[union-attr]
            block_hashes = request.block_hashes
            num_probes = min(max_cache_hit_length // block_size, len(block_hashes))
            get = hit_map.get
            hits: list[KVCacheBlock] = []
            for index in range(num_probes):
                block = get(block_hashes[index])
                if block is None:
                    break
                hits.append(block)
            if not hits:
                return self._empty_computed
            result = KVCacheBlocks((hits,))
            num_hit_tokens = len(hits) * block_size
        else:
            hit_blocks, num_hit_tokens, num_uncached = self.coordinator.find_longest_cache_hit(
                request.block_hashes, max_cache_hit_length
            )
            # A shared prefix some group cached past the reconciled hit: the position a
            # sparse-retention group must keep once it computes it (0 if none).
            boundary = num_hit_tokens + num_uncached if num_uncached else 0
            result = self.create_kv_cache_blocks(hit_blocks)
            if result is self.empty_kv_cache_blocks:
                return ComputedBlocks(result, 0, boundary) if boundary else self._empty_computed
            self._checker.record_lookup(request, result)
            return ComputedBlocks(result, num_hit_tokens, boundary)
        self._checker.record_lookup(request, result)
        return ComputedBlocks(result, num_hit_tokens, 0)

    # ------------------------------------------------------------------ allocation

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens of `request` (layout in docs/design.md).

        `skip_zeroing_group_ids`: groups whose blocks for external tokens an asynchronous load
        writes, so they are not recorded for zeroing.

        Returns:
            The newly allocated blocks per group (the shared empty value if none), or None if
            they do not fit, in which case nothing was allocated.
        """
        # Hot path: a running request's decode step (or next prefill chunk) passes none of the
        # optional arguments; it skips their checks, the stage-by-stage fan-out over the groups
        # and the hit machinery. The running allocator gives exactly the general path's result.
        allocator = self._running_allocator
        if (
            new_computed_blocks is None
            and allocator is not None
            and type(request) is Request  # anything else is validated (and refused) below
            and request.status is RequestStatus.RUNNING
            and self._requests.get(request.request_id) is request
            and not (
                num_new_computed_tokens
                or num_external_computed_tokens
                or num_lookahead_tokens
                or reserved_blocks
                or full_sequence_must_fit
                or num_encoder_tokens
            )
            and type(num_new_tokens) is int
            and num_new_tokens > 0
            and request.num_computed_tokens + num_new_tokens <= self.max_model_len
        ):
            return allocator.allocate(
                request, num_new_tokens, self.enable_caching and not delay_cache_blocks
            )
        # The fast path above changes the pool only through calls that check the thread.
        self.owner_thread.check("KVCacheManager.allocate_slots")
        hits = self._checker.check_allocation(
            request,
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_encoder_tokens,
            reserved_blocks,
        )
        coordinator = self.coordinator
        request_id = request.request_id
        max_model_len = self.max_model_len
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        total_computed = min(num_local_computed + num_external_computed_tokens, max_model_len)
        # The watermark holds back blocks from new admissions only; a running request may use
        # every block, and the very first admission is never blocked.
        watermark_blocks = (
            self.watermark_blocks
            if has_scheduled_reqs
            and request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            else 0
        )
        num_free = self.block_pool.free_block_queue.num_free_blocks
        # The scheduler's prefill boundary (resumed requests replay their output tokens).
        prefill_end = max(request.num_prompt_tokens, request.num_tokens - 1)
        if full_sequence_must_fit:
            num_full_tokens = min(request.num_tokens, max_model_len)
            num_needed = coordinator.get_num_blocks_to_allocate(
                request_id,
                num_full_tokens,
                hits,
                total_computed,
                num_encoder_tokens,
                apply_admission_cap=True,
                num_tokens_main_model=num_full_tokens,
                prefill_end=prefill_end,
                num_local_computed_tokens=num_local_computed,
            )
            if num_needed + watermark_blocks > num_free:
                return None
        num_tokens_main_model = total_computed + num_new_tokens
        num_tokens_need_slot = min(num_tokens_main_model + num_lookahead_tokens, max_model_len)
        # Free blocks that fell out of the attention window, on the processed-token basis.
        coordinator.remove_skipped_blocks(
            request_id,
            max(0, total_computed - request.num_in_flight_tokens),
            request.num_prompt_tokens,
        )
        num_blocks_to_allocate = coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens_need_slot,
            hits,
            num_local_computed + num_external_computed_tokens,
            num_encoder_tokens,
            num_tokens_main_model=num_tokens_main_model,
            prefill_end=prefill_end,
            num_local_computed_tokens=num_local_computed,
        )
        num_available = self.block_pool.free_block_queue.num_free_blocks - reserved_blocks
        if num_blocks_to_allocate + watermark_blocks > num_available:
            return None
        if hits is not self._empty_hits or num_external_computed_tokens > 0:
            coordinator.allocate_new_computed_blocks(
                request_id,
                hits,
                num_local_computed,
                num_external_computed_tokens,
                skip_zeroing_group_ids,
            )
            if self._retention is not None and request.retention is not None:
                self._retain_hits(request, hits)
        if self._signals is not None:
            # Scheduled: its hits are held now; the rest it wanted need no protection.
            self._signals.note_not_waiting(request)
        new_blocks = coordinator.allocate_new_blocks(
            request_id, num_tokens_need_slot, num_encoder_tokens, num_tokens_main_model
        )
        self._requests[request_id] = request
        if self.enable_caching and not delay_cache_blocks:
            # Capped at num_tokens: unverified draft tokens never enter the cache.
            coordinator.cache_blocks(
                request, min(total_computed + num_new_tokens, request.num_tokens)
            )
        return self.create_kv_cache_blocks(new_blocks)

    def _retain_hits(self, request: Request, hits: tuple[Sequence[KVCacheBlock], ...]) -> None:
        """Apply the request's retention hints to the prefix-cache hits it just adopted."""
        retention = self._retention
        assert retention is not None
        for group, blocks in zip(self.kv_cache_config.kv_cache_groups, hits, strict=True):
            if blocks:
                retention.apply_hints(
                    request, blocks, 0, len(blocks), group.kv_cache_spec.block_size, None, False
                )

    def allocate_decode_slots(self, requests: Sequence[Request], start: int = 0) -> DecodeSlots:
        """Give each running request in `requests[start:]` one more token slot, in order.

        Stops at the first request that does not fit (nothing is allocated for it or after it);
        the caller preempts and calls again from there, as it would with `allocate_slots`.
        Equivalent to `allocate_slots(request, 1)` for each request, without the per-call cost.

        Returns:
            `DecodeSlots(num_allocated, requests_with_new_blocks)`: how many requests from
            `start` got their slot, and those of them that needed a new block.
        """
        check_count("start", start)
        self.owner_thread.check("KVCacheManager.allocate_decode_slots")  # once per step
        allocator = self._running_allocator
        if allocator is not None:
            live = self._requests
            max_model_len = self.max_model_len
            running = RequestStatus.RUNNING
            for index in range(start, len(requests)):
                request = requests[index]
                if (
                    request.status is not running
                    or live.get(request.request_id) is not request
                    or request.num_computed_tokens >= max_model_len
                ):
                    break
            else:
                return allocator.allocate_decode(requests, start, self.enable_caching)
        return self._allocate_decode_slots_slow(requests, start)

    def _allocate_decode_slots_slow(self, requests: Sequence[Request], start: int) -> DecodeSlots:
        """The general path (any groups), validating each request as `allocate_slots` does."""
        for request in requests[start:]:
            if self._requests.get(request.request_id) is not request:
                raise RequestStateError(
                    f"allocate_decode_slots: request {request.request_id!r} holds no blocks "
                    "here; admit it with allocate_slots first"
                )
            self._checker.check_allocation(request, 1, 0, None, 0, 0, 0, 0)
        with_new_blocks: list[Request] = []
        for index in range(start, len(requests)):
            new_blocks = self.allocate_slots(requests[index], 1)
            if new_blocks is None:
                return DecodeSlots(index - start, with_new_blocks)
            if new_blocks is not self.empty_kv_cache_blocks:
                with_new_blocks.append(requests[index])
        return DecodeSlots(len(requests) - start, with_new_blocks)

    # ------------------------------------------------------------------ freeing

    def free(self, request: Request) -> None:
        """Release all of the request's blocks (unknown requests: a no-op)."""
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("KVCacheManager.free")
        request_id = request.request_id
        live = self._requests
        if live.get(request_id) is request:
            del live[request_id]
        elif request_id in live:
            return  # another live request owns this id; nothing of ours to free
        signals = self._signals
        if signals is not None:
            signals.note_not_waiting(request)
            signals.note_freeing(request)
        allocator = self._running_allocator
        if allocator is not None:
            allocator.free(request_id)  # Hot path: the coordinator's fan-out, inlined
        else:
            self.coordinator.free(request_id)
        if signals is not None:
            signals.end_free()

    # ------------------------------------------------------------------ the waiting queue

    def add_waiting(self, request: Request) -> None:
        """`request` entered the waiting queue (arrived, or came back after a preemption).

        With the look-ahead on, the free blocks it will hit are evicted last until it leaves
        the queue: its first successful `allocate_slots`, `remove_waiting` or `free`. Session
        policies note its arrival. Call once per entry into the queue; a no-op for plain LRU.
        """
        signals = self._signals
        if signals is not None:
            self.owner_thread.check("KVCacheManager.add_waiting")
            signals.note_waiting(request)

    def remove_waiting(self, request: Request) -> None:
        """`request` left the waiting queue without allocating (aborted, or dropped)."""
        signals = self._signals
        if signals is not None:
            self.owner_thread.check("KVCacheManager.remove_waiting")
            signals.note_not_waiting(request)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget the request's blocks without freeing them; free later with
        `block_pool.free_blocks(reversed(blocks))`."""
        self.owner_thread.check("KVCacheManager.pop_blocks_for_free")
        if self._requests.get(request.request_id) is request:
            del self._requests[request.request_id]
        elif request.request_id in self._requests:
            return []  # another live request owns this id (as in `free`)
        return self.coordinator.pop_blocks_for_free(request.request_id)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Free the request's blocks no group needs once `processed_computed_tokens` are done
        (outside a window); `num_prompt_tokens` lets an R-SWA group free its gap."""
        check_count("processed_computed_tokens", processed_computed_tokens)
        if num_prompt_tokens is not None:
            check_count("num_prompt_tokens", num_prompt_tokens)
        self.owner_thread.check("KVCacheManager.remove_skipped_blocks")
        self.coordinator.remove_skipped_blocks(
            request_id, processed_computed_tokens, num_prompt_tokens
        )

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Record the request's blocks from `start_token` on for zeroing again (after a failed
        KV load left them unwritten); `start_token` must be block aligned in each group."""
        self.owner_thread.check("KVCacheManager.record_blocks_for_zeroing")
        check_count("start_token", start_token)
        self.coordinator.record_blocks_for_zeroing(request_id, start_token)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Cache the request's full blocks up to `num_computed_tokens` (async scheduling)."""
        self.owner_thread.check("KVCacheManager.cache_blocks")
        if not self.enable_caching:
            return
        check_count("num_computed_tokens", num_computed_tokens)
        if num_computed_tokens > request.num_tokens:
            raise InvalidArgumentError(
                f"cannot cache {num_computed_tokens} tokens of request {request.request_id!r}: "
                f"it has {request.num_tokens}"
            )
        if self._requests.get(request.request_id) is not request:
            raise RequestStateError(f"request {request.request_id!r} holds no blocks here")
        self.coordinator.cache_blocks(request, num_computed_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        """Drop the prefix-cache entries of these blocks (for example after a failed KV load)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (and nothing changes) while blocks are held."""
        self.owner_thread.check("KVCacheManager.reset_prefix_cache")
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def new_step_starts(self) -> None:
        self.owner_thread.check("KVCacheManager.new_step_starts")
        self.coordinator.new_step_starts()

    def release_owner_thread(self) -> None:
        """Hand the manager (and its pool) over: the next thread that changes it owns it.

        Call it from the owner thread, before another thread takes over (an engine moving its
        scheduler loop); a thread that owns nothing is refused (`ThreadOwnershipError`). Not
        needed when the owner thread has ended: the next thread takes over then.
        """
        self.owner_thread.release()

    # ------------------------------------------------------------------ reads, stats and events

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def get_eviction_stats(self) -> EvictionStats:
        """The eviction policy, retention and host-tier counters (`pagedkv.eviction`)."""
        return self.block_pool.get_eviction_stats()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones (None if off)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        """Count one admitted request's lookup (preempted requests apart)."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        # None only with allow_none=True and no blocks; the default never returns it.
        return self.get_blocks(request_id).get_block_ids()  # type: ignore[return-value]

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        if all(not group for group in blocks):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(blocks)

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, leading blocks of the request held by every request holding blocks."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids per group, token-indexed groups clipped to the computed tokens' blocks.

        Cross-attention and Mamba groups are not indexed by decoder tokens: kept whole.
        """
        check_count("num_computed_tokens", num_computed_tokens)
        return self.coordinator.get_block_ids_for_computed_tokens(request_id, num_computed_tokens)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix in the prefix cache: per cacheable group, the end of
        its last hashed block; the minimum over groups (0 if none)."""
        return self.coordinator.estimate_cached_tokens(request.request_id)

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Drain the block copies queued by sub-block hits since the last call (vLLM 0.33's
        contract): `(copies, retained)`. The worker copies each `src_block_id`'s KV into its
        `dst_block_id` before the step's forward runs; once it has, release both ends with
        `block_pool.free_blocks(retained)` (until then they cannot be reused)."""
        pairs = self.coordinator.take_pending_cow_copies()
        if not pairs:
            return [], []
        copies = [KVCacheBlockCopy(source.block_id, copy.block_id) for source, copy in pairs]
        return copies, [block for pair in pairs for block in pair]

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids of attention blocks allocated since the last call, for the worker to
        zero (recorded only with `KVCacheConfig.needs_kv_cache_zeroing`)."""
        self.owner_thread.check("KVCacheManager.take_new_block_ids")
        return self.coordinator.take_new_block_ids()

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the pool's events, annotating `BlockStored` with its group's spec kind."""
        events = self.block_pool.take_events()
        annotate_block_stored(events, self.kv_cache_event_metadata)
        return events

    def check_invariants(self, held_outside: Iterable[KVCacheBlock] = ()) -> None:
        """Check the pool, every manager and the facade's request registry.

        `held_outside`: blocks popped by `pop_blocks_for_free` and not freed yet (each
        occurrence is one reference no block table accounts for).
        """
        self.coordinator.check_invariants(held_outside)
        null_block = self.block_pool.null_block
        for group_id, manager in enumerate(self.coordinator.single_type_managers):
            for request_id, blocks in manager.req_to_blocks.items():
                request = self._requests.get(request_id)
                if request is None:
                    raise InvariantViolation(f"request {request_id!r} holds blocks but is unknown")
                if not manager.enable_caching:
                    continue
                hashes = manager.resolve_hashes(request.block_hashes)
                for index in range(manager.num_cached_block.get(request_id, 0)):
                    block = blocks[index]
                    if block is null_block or block.block_hash is None:
                        continue  # evict_blocks may drop the entry of a held block
                    if (
                        index >= len(hashes)
                        or block.block_hash != hashes[index]
                        or block.hash_group_id != group_id
                    ):
                        raise InvariantViolation(
                            f"request {request_id!r}: block {block.block_id} at position {index} "
                            f"of group {group_id} is cached under another hash"
                        )
        usage = self.usage
        if not 0.0 <= usage <= 1.0:
            raise InvariantViolation(f"usage {usage} outside [0, 1]")

    # ------------------------------------------------------------------ the host-memory tier

    def get_num_host_hit_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens right after the first `num_computed_tokens` that the host-memory tier holds
        (whole blocks; at most `num_tokens - 1` in all, as for device hits). Changes nothing.

        Returns:
            0 without a host tier; else pass the count to `allocate_slots` as
            `num_external_computed_tokens`, then call `load_from_host` once it is allocated.
        """
        host = self.block_pool.host_tier
        if host is None or request.skip_reading_prefix_cache:
            return 0
        check_count("num_computed_tokens", num_computed_tokens)
        block_size = self.hash_block_size
        stop = min((request.num_tokens - 1) // block_size, len(request.block_hashes))
        start = num_computed_tokens // block_size
        if num_computed_tokens % block_size or start > stop:
            raise InvalidArgumentError(
                f"num_computed_tokens={num_computed_tokens} is not a whole number of "
                f"{block_size}-token blocks within request {request.request_id!r}'s prompt"
            )
        return host.count_hits(request.block_hashes, start, stop) * block_size

    def load_from_host(self, request: Request, num_computed_tokens: int, num_tokens: int) -> None:
        """Record the load of tokens `[num_computed_tokens, +num_tokens)` from the host tier
        into the request's blocks (call after `allocate_slots` took them as external tokens):
        the host entries become its most recently used (promotion keeps the host copy)."""
        self.owner_thread.check("KVCacheManager.load_from_host")
        host = self.block_pool.host_tier
        if host is None or num_tokens == 0:
            return
        block_size = self.hash_block_size
        check_count("num_computed_tokens", num_computed_tokens)
        check_count("num_tokens", num_tokens)
        if (
            num_computed_tokens % block_size
            or num_tokens % block_size
            or (self._requests.get(request.request_id) is not request)
        ):
            raise RequestStateError(
                f"request {request.request_id!r}: load_from_host({num_computed_tokens}, "
                f"{num_tokens}) needs whole blocks of a request holding blocks here"
            )
        start = num_computed_tokens // block_size
        # Entries the allocation itself pushed out were read before their slot was reused.
        host.promote(request.block_hashes[start : start + num_tokens // block_size])

    # ------------------------------------------------------------------ keys-only replay

    def try_prefill_and_free(
        self, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> int | None:
        """Run a prompt through as a request that arrives alone, computes it and finishes.

        Block for block the same as `get_computed_blocks`, `allocate_slots(request, num_tokens
        - hit, hit, hit_blocks, has_scheduled_reqs=False)` and `free` of a request with these
        block hashes, without building the request: for trace replay, where only the keys
        matter. Keys are only compared (a hasher's digests, or any hashable keys equal iff the
        prefixes are equal). Needs one full-attention group and KV events off (a BlockStored
        event carries token ids). Changes nothing unless the whole prompt fits.

        Returns:
            The prompt's prefix-hit tokens, or None if it does not fit.
        """
        manager = self._fast_manager
        if manager is None or self.enable_kv_cache_events:
            raise ConfigError(
                "try_prefill_and_free needs one full-attention KV-cache group and KV events "
                "off; use get_computed_blocks, allocate_slots and free"
            )
        check_count("num_tokens", num_tokens, 1)
        if num_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"a {num_tokens}-token prompt exceeds max_model_len {self.max_model_len}"
            )
        num_full_blocks = num_tokens // manager.block_size
        if self.enable_caching and len(block_hashes) < num_full_blocks:
            raise InvalidArgumentError(
                f"a {num_tokens}-token prompt has {num_full_blocks} full blocks but "
                f"{len(block_hashes)} block hashes"
            )
        self.owner_thread.check("KVCacheManager.try_prefill_and_free")
        return manager.prefill_and_free(block_hashes, num_tokens)
