"""`PagedKVCacheManager`: vLLM 0.33's `KVCacheManager` interface, answered by pagedkv's core.

vLLM's `Scheduler` builds it with the same 16 keyword arguments it gives its own manager, with
vLLM's `KVCacheConfig` and `Request` objects. Requests reach the core as views sharing their
token and hash lists; results come back as pagedkv's `KVCacheBlocks` (the same methods as
vLLM's), statistics as vLLM's `PrefixCacheStats`, events as vLLM's event types.
"""

from __future__ import annotations

from collections.abc import Sequence

from vllm.distributed.kv_events import BlockStored as VllmBlockStored
from vllm.v1.core import kv_cache_manager as vllm_kv_cache_manager
from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
from vllm.v1.kv_cache_interface import (
    KVCacheConfig,
    MambaSpec,
    get_kv_cache_spec_kind,
    get_kv_cache_spec_sliding_window,
)
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.request import Request
from vllm.v1.request import RequestStatus as VllmStatus

from pagedkv.block import KVCacheBlock
from pagedkv.coordinators.hybrid import HybridKVCacheCoordinator
from pagedkv.errors import InvalidArgumentError
from pagedkv.integrations.vllm.config import as_vllm_int, check_as_vllm, translate_config
from pagedkv.integrations.vllm.events import to_vllm_events
from pagedkv.integrations.vllm.kv_hints import KvHintReader
from pagedkv.integrations.vllm.options import DEFAULT_OPTIONS, PagedKVOptions
from pagedkv.integrations.vllm.requests import (
    VIEW_ATTRIBUTE,
    existing_view,
    map_status,
    sync_view,
)
from pagedkv.integrations.vllm.views import BlockPoolView, CoordinatorView
from pagedkv.kv_cache_blocks import ComputedBlocks, KVCacheBlocks
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.managers import MambaAlignManager
from pagedkv.request import Request as PagedKVRequest
from pagedkv.request import RequestStatus


def _event_metadata(kv_cache_config: KVCacheConfig) -> tuple[tuple[str, int | None], ...]:
    """Per group, the spec kind and window vLLM annotates its `BlockStored` events with (its
    own kind names, which differ from pagedkv's for specs pagedkv translates)."""
    return tuple(
        (
            get_kv_cache_spec_kind(group.kv_cache_spec).value,
            get_kv_cache_spec_sliding_window(group.kv_cache_spec),
        )
        for group in kv_cache_config.kv_cache_groups
    )


class TruncationError(InvalidArgumentError, AssertionError):
    """`truncate_computed_blocks` past what a hit covers; an `AssertionError` too, the type
    vLLM's manager refuses it with."""


class PagedKVCacheManager:
    """vLLM's KV-cache manager interface on pagedkv.

    Invariant: `core` owns every block; this class keeps only vLLM-facing state (the
    `PrefixCacheStats` object and the event metadata) and never changes a block itself.
    Not supported (refused at construction): decode/prefill context parallelism > 1 and the
    spec types `config.translate_spec` lists. The Mamba shared-prefix checkpoint is narrowed
    as vLLM narrows it (an EAGLE Mamba "align" model with sub-block hash hits).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        scheduler_block_size: int,
        hash_block_size: int,
        max_in_flight_tokens: int | None = None,
        enable_caching: bool = True,
        use_eagle: bool = False,
        num_hash_lookahead_tokens: int = 0,
        num_prefill_lookahead: int = 0,
        log_stats: bool = False,
        enable_kv_cache_events: bool = False,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
        metrics_collector: object | None = None,
        watermark: float = 0.0,
        enable_mamba_shared_prefix_checkpoint: bool = False,
        pagedkv_options: PagedKVOptions = DEFAULT_OPTIONS,
    ) -> None:
        # vLLM's meaning for counts given as bools (0 or 1), then vLLM's own refusals.
        num_hash_lookahead_tokens = as_vllm_int(num_hash_lookahead_tokens)
        num_prefill_lookahead = as_vllm_int(num_prefill_lookahead)
        dcp_world_size = as_vllm_int(dcp_world_size)
        pcp_world_size = as_vllm_int(pcp_world_size)
        check_as_vllm(
            kv_cache_config,
            scheduler_block_size,
            hash_block_size,
            enable_caching,
            use_eagle,
            num_prefill_lookahead,
            watermark,
        )
        # `pagedkv_options`: from `additional_config["pagedkv"]` (`options.py`; the Scheduler
        # subclass passes them); the defaults build vLLM's LRU order.
        self.pagedkv_options = pagedkv_options
        self.kv_hints = KvHintReader(pagedkv_options.retention)
        self.core = KVCacheManager(
            translate_config(kv_cache_config),
            max_model_len,
            scheduler_block_size=scheduler_block_size,
            hash_block_size=hash_block_size,
            max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=enable_caching,
            use_eagle=use_eagle,
            num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            num_prefill_lookahead=num_prefill_lookahead,
            enable_kv_cache_events=enable_kv_cache_events,
            dcp_world_size=dcp_world_size,
            pcp_world_size=pcp_world_size,
            # vLLM's collector types its hooks' argument as vLLM's block; it reads only
            # `block_id`, which pagedkv's blocks have too.
            metrics_collector=metrics_collector,  # type: ignore[arg-type]
            watermark=watermark,
            eviction=pagedkv_options.eviction_config(),
        )
        # vLLM adopts any free block of the pool a caller names as a hit (uncached ones too);
        # pagedkv's core refuses those unless told (lead decision, issue 23).
        self.core.accept_uncached_free_hits(True)
        # vLLM's scheduler drains the Mamba boundary-state offers every step.
        self._offering_managers = [
            manager
            for manager in self.core.coordinator.single_type_managers
            if isinstance(manager, MambaAlignManager)
        ]
        for manager in self._offering_managers:
            manager.record_boundary_state_offloads = True
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.metrics_collector = metrics_collector
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self.hash_block_size = hash_block_size
        # vLLM's narrowing: an EAGLE Mamba "align" model with sub-block hits, and no
        # re-prefillable tokens (multi-module MTP caches less than the chunk end).
        coordinator = self.core.coordinator
        self.mamba_shared_prefix_checkpoint = bool(
            enable_mamba_shared_prefix_checkpoint
            and coordinator.eagle_group_ids
            and coordinator.enable_partial_hash_hits
            and coordinator.num_reprefillable_tokens == 0
        )
        for manager in self._offering_managers:
            manager.shared_prefix_checkpoint = self.mamba_shared_prefix_checkpoint
        groups = kv_cache_config.kv_cache_groups
        self.num_kv_cache_groups = len(groups)
        self.coordinator = CoordinatorView.for_coordinator(
            self.core.coordinator,
            [group.kv_cache_spec for group in groups],
            self.core.scheduler_block_size,
            self._set_retention_interval,  # vLLM's tests set coordinator.retention_interval
        )
        self.block_pool = BlockPoolView(self.core.block_pool)
        self.retained_hit_group_ids: tuple[int, ...] = ()
        self.watermark_blocks = self.core.watermark_blocks
        self.kv_cache_event_metadata = _event_metadata(kv_cache_config)
        self.empty_kv_cache_blocks = self.core.empty_kv_cache_blocks
        # The core's running allocator and live-request map, for `allocate_slots`' hot path
        # (both live as long as the core; the map is updated in place).
        self._running_allocator = self.core._running_allocator
        self._live_requests = self.core._requests
        self._is_mamba = tuple(isinstance(group.kv_cache_spec, MambaSpec) for group in groups)

    def _set_retention_interval(self, interval: int | None) -> None:
        self.core.set_retention_interval(interval)
        self._running_allocator = self.core._running_allocator

    # ------------------------------------------------------------------ reading

    @property
    def usage(self) -> float:
        return self.core.usage

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """Return the stats gathered since the last call and start new ones (None if off)."""
        if not self.log_stats:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Request, num_hits: int) -> None:
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def get_computed_blocks(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> ComputedBlocks:
        return self.core.get_computed_blocks(
            sync_view(request, self.hash_block_size), max_cache_hit_length
        )

    def get_computed_blocks_for_connector(
        self, request: Request, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int, bool]:
        """The local hit for a connector that can restore Mamba state (vLLM 0.33's rule).

        On a Mamba + full-attention model the full-attention hit is reported, with
        `hit_diverged` when a lagging group hit less; if a group hit deeper than full
        attention (its blocks were evicted), the reconciled hit of `get_computed_blocks`.
        """
        coordinator = self.core.coordinator
        # Only the hybrid coordinator has a full-attention group id (None without one).
        if not (
            self.kv_cache_config.has_mamba_layers
            and isinstance(coordinator, HybridKVCacheCoordinator)
            and coordinator.full_attention_group_id is not None
        ):
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        full_group_id = coordinator.full_attention_group_id
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0, False
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        blocks, hit_lengths = coordinator.find_longest_cache_hit_per_group(
            request.block_hashes, max_cache_hit_length
        )
        num_local = hit_lengths[full_group_id]
        if any(hit_length > num_local for hit_length in hit_lengths):
            return *self.get_computed_blocks(request, max_cache_hit_length), False
        result = self.core.create_kv_cache_blocks(blocks)
        return result, num_local, 0, min(hit_lengths) < num_local

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return self.core.get_blocks(request_id)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.core.get_block_ids(request_id)

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids per group; attention groups clipped to the blocks of the computed tokens."""
        return self.core.get_block_ids_for_computed_tokens(request_id, num_computed_tokens)

    def estimate_cached_tokens(self, request: Request) -> int:
        """Tokens of the request's prefix that are in the prefix cache (min over groups)."""
        return self.core.estimate_cached_tokens(sync_view(request, self.hash_block_size))

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Deprecated in vLLM 0.33 (cascade attention was removed): zeros, as vLLM returns."""
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return self.core.create_kv_cache_blocks(blocks)

    def truncate_computed_blocks(
        self, blocks: KVCacheBlocks, num_computed_tokens: int
    ) -> KVCacheBlocks:
        """The lookup result cut at `num_computed_tokens` (Mamba groups keep what they have)."""
        truncated: list[Sequence[KVCacheBlock]] = []
        for group_id, group_blocks in enumerate(blocks.blocks):
            group = self.kv_cache_config.kv_cache_groups[group_id]
            if not group.kv_cache_spec.prefix_cacheable:
                truncated.append([])
                continue
            block_size = self.core.coordinator.single_type_managers[group_id].block_size
            if num_computed_tokens % block_size:
                raise TruncationError(
                    f"cannot truncate a hit at {num_computed_tokens} tokens: not a multiple of "
                    f"group {group_id}'s block size {block_size}"
                )
            num_blocks = num_computed_tokens // block_size
            if self._is_mamba[group_id]:
                # An external hit may supply the last Mamba state past the local one.
                num_blocks = min(num_blocks, len(group_blocks))
            elif num_blocks > len(group_blocks):
                raise TruncationError(
                    f"cannot truncate a hit at {num_computed_tokens} tokens: group {group_id} "
                    f"has only {len(group_blocks)} hit blocks of {block_size} tokens"
                )
            truncated.append(list(group_blocks[:num_blocks]))
        return self.core.create_kv_cache_blocks(tuple(truncated))

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
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> KVCacheBlocks | None:
        # Hot path: a running request's decode step (vLLM's scheduler passes only the new and
        # lookahead tokens) goes straight to the core's running allocator, one forwarding
        # layer instead of two. These are the conditions of the core's own fast path
        # (`KVCacheManager.allocate_slots`), which gives the same result; the view is synced
        # as `sync_view` does (the status is RUNNING, no new multimodal item).
        allocator = self._running_allocator
        view: PagedKVRequest | None = request.__dict__.get(VIEW_ATTRIBUTE)
        if (
            view is not None
            and allocator is not None
            and request.status is VllmStatus.RUNNING
            and new_computed_blocks is None
            and not (
                num_new_computed_tokens
                or num_external_computed_tokens
                or num_lookahead_tokens
                or reserved_blocks
                or full_sequence_must_fit
                or num_encoder_tokens
            )
            and len(view.mm_features) == len(request.mm_features)
            and self._live_requests.get(view.request_id) is view
            and type(num_new_tokens) is int
            and num_new_tokens > 0
        ):
            num_computed_tokens = request.num_computed_tokens
            if num_computed_tokens + num_new_tokens <= self.max_model_len:
                view.num_tokens = len(view.all_token_ids)
                view.num_prompt_tokens = request.num_prompt_tokens
                view.num_computed_tokens = num_computed_tokens
                view.num_in_flight_tokens = request.num_in_flight_tokens
                view.num_preemptions = request.num_preemptions
                view.shared_prefix_boundary = request.shared_prefix_boundary
                view.status = RequestStatus.RUNNING
                return allocator.allocate(
                    view, num_new_tokens, self.enable_caching and not delay_cache_blocks
                )
        return self.core.allocate_slots(
            sync_view(request, self.hash_block_size),
            num_new_tokens,
            num_new_computed_tokens,
            new_computed_blocks,
            num_lookahead_tokens,
            num_external_computed_tokens,
            delay_cache_blocks,
            num_encoder_tokens,
            full_sequence_must_fit,
            reserved_blocks,
            has_scheduled_reqs,
            skip_zeroing_group_ids,
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if self.enable_caching:
            self.core.cache_blocks(sync_view(request, self.hash_block_size), num_computed_tokens)

    # ------------------------------------------------------------------ freeing

    def free(self, request: Request) -> None:
        view = existing_view(request)
        if view is not None:
            # Finished, or still running (a preemption): what a session policy asks.
            view.status = map_status(request.status)
            self.core.free(view)

    def add_waiting(self, request: Request) -> None:
        """`request` entered vLLM's waiting queue (the Scheduler subclass calls this at arrival
        and preemption): its KV hints are read once, and with the look-ahead or a session
        policy the core hears of it. Nothing is done with the default options and no hints."""
        hints = request.kv_hints
        if hints is None and self.pagedkv_options.is_default:
            return
        view = sync_view(request, self.hash_block_size)
        if hints is not None and not request.num_preemptions:  # read once, at arrival
            view.retention = self.kv_hints.retention_for(hints)
        self.core.add_waiting(view)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        view = existing_view(request)
        if view is None:
            return []
        return self.core.pop_blocks_for_free(view)

    def remove_skipped_blocks(
        self,
        request_id: str,
        processed_computed_tokens: int,
        num_prompt_tokens: int | None = None,
    ) -> None:
        self.core.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def evict_blocks(self, block_ids: set[int]) -> None:
        self.core.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        if not self.core.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def new_step_starts(self) -> None:
        self.core.new_step_starts()

    # ------------------------------------------------------------------ worker hand-offs

    def take_events(self) -> list:
        """Drain the events as vLLM's types, `BlockStored` annotated with its group's kind.

        Events already of vLLM's types (vLLM code may append them to `kv_event_queue`) pass
        through; the annotation is vLLM's, with its warning for a group index out of range.
        """
        events = self.core.block_pool.take_events()
        if not events:
            return []
        converted = to_vllm_events(events)
        metadata = self.kv_cache_event_metadata
        for event in converted:
            if type(event) is not VllmBlockStored or event.group_idx is None:
                continue
            if not 0 <= event.group_idx < len(metadata):
                # Looked up at call time: vLLM's tests patch the module's logger.
                vllm_kv_cache_manager.logger.warning(
                    "Group index `%s` not in KV cache metadata", event.group_idx
                )
                continue
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = metadata[event.group_idx]
        return converted

    def take_new_block_ids(self) -> list[int]:
        """New attention blocks since the last call, for the worker to zero."""
        return self.core.take_new_block_ids()

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        self.core.record_blocks_for_zeroing(request_id, start_token)

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """The copies sub-block hits queued (vLLM's type) and their retained ends, which the
        scheduler frees once the step that runs the copies is done."""
        copies, retained = self.core.take_kv_cache_block_copies()
        if not copies:
            return [], []
        return [KVCacheBlockCopy(copy.src_block_id, copy.dst_block_id) for copy in copies], retained

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """This step's Mamba "align" boundary states for a KV connector, as vLLM's:
        `{request_id: [(group_id, block_id, boundary_tokens), ...]}` (empty otherwise)."""
        offloads: dict[str, list[tuple[int, int, int]]] = {}
        for manager in self._offering_managers:
            for (
                request_id,
                group_id,
                block,
                boundary_tokens,
            ) in manager.take_pending_boundary_state_offloads():
                offloads.setdefault(request_id, []).append(
                    (group_id, block.block_id, boundary_tokens)
                )
        return offloads

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        """A finishing request's own tail states a connector may still offload (vLLM 0.33):
        `[(group_id, block_id, boundary_tokens)]`."""
        offloads: list[tuple[int, int, int]] = []
        for manager in self._offering_managers:
            finalized = manager.finalize_partial_tail_offload(
                request.request_id, request.num_computed_tokens, request.num_in_flight_tokens
            )
            if finalized is not None:
                group_id, block, boundary_tokens = finalized
                offloads.append((group_id, block.block_id, boundary_tokens))
        return offloads
