"""Coordinator: builds the pool and one manager per KV-cache group, fans calls out to groups,
and finds the prefix hit valid in every group. `pagedkv.coordinators.make_coordinator` picks one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from math import lcm
from typing import TYPE_CHECKING

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool, BlockResidencyObserver
from pagedkv.errors import ConfigError, InvalidArgumentError, InvariantViolation
from pagedkv.eviction import EvictionConfig
from pagedkv.managers import (
    ChunkedLocalAttentionManager,
    MambaAlignManager,
    SingleTypeKVCacheManager,
    manager_class_for,
)
from pagedkv.specs import (
    AttentionSpec,
    CrossAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SpecDecodeConfig,
    cdiv,
)

if TYPE_CHECKING:
    from pagedkv.request import Request

BlockLists = tuple[Sequence[KVCacheBlock], ...]
NO_SPEC_DECODE = SpecDecodeConfig()


def replay_boundaries(
    num_prompt_tokens: int, scheduler_block_size: int, use_eagle: bool
) -> tuple[int, ...]:
    """Token positions a later request replaying this prompt can resume at.

    A resend of the same prompt hits at most `num_prompt_tokens - 1` tokens. With EAGLE, hits
    drop one block, so a resend and a longer sibling resume one block below the last aligned
    boundary of `num_prompt_tokens - 1` and of `num_prompt_tokens` respectively.
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))


class KVCacheCoordinator:
    """Fans manager calls out to every group; subclasses differ only in the hit search.

    Invariant (`check_invariants`): every block's `ref_cnt` equals the number of block tables,
    across all groups, that hold it. `cache_blocks(request, n)` caches each caching group's
    full, hashed blocks up to `get_num_cacheable_tokens(n, group_id)` (without speculative
    decoding: `n` rounded down to a multiple of `cache_alignment_tokens`).
    `drop_eagle_group_ids` are the groups whose hits drop the EAGLE block (`eagle_group_ids`,
    the draft groups, when `use_eagle` is on).
    """

    cache_alignment_tokens = 1

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        hash_block_size: int,
        enable_caching: bool,
        enable_kv_cache_events: bool = False,
        max_in_flight_tokens: int | None = None,
        metrics_collector: BlockResidencyObserver | None = None,
        alignment_tokens: int | None = None,
        eviction: EvictionConfig | None = None,
        spec_decode: SpecDecodeConfig = NO_SPEC_DECODE,
        context_parallel: tuple[int, int] = (1, 1),
    ) -> None:
        self.kv_cache_config = kv_cache_config
        # Context parallelism: the managers' block sizes are already scaled (their config).
        self.dcp_world_size, self.pcp_world_size = context_parallel
        self.retention_interval = kv_cache_config.prefix_cache_retention_interval
        """The sparse-retention interval in force (`set_retention_interval`); the config keeps
        the one given at construction."""
        self.max_model_len = max_model_len
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        self.spec_decode = spec_decode
        self.num_reprefillable_tokens = spec_decode.num_reprefillable_tokens
        groups = kv_cache_config.kv_cache_groups
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            num_kv_cache_groups=max(len(groups), 1),
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=metrics_collector,
            eviction=eviction,
            num_hash_lookahead_tokens=spec_decode.num_hash_lookahead_tokens,
        )
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        managers = self._make_managers(max_model_len, in_flight, alignment_tokens)
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = managers
        for manager in managers:
            sharded = manager.kv_cache_spec.dcp_sharded
            manager.dcp_world_size = self.dcp_world_size if sharded else 1
            manager.pcp_world_size = self.pcp_world_size if sharded else 1
        self._is_cross = tuple(isinstance(g.kv_cache_spec, CrossAttentionSpec) for g in groups)
        eagle_group_ids = {i for i, group in enumerate(groups) if group.is_eagle_group}
        if spec_decode.use_eagle and not eagle_group_ids:
            eagle_group_ids = set(range(len(groups)))  # no group flagged: all of them
        self.eagle_group_ids = frozenset(eagle_group_ids)
        self.drop_eagle_group_ids = (
            self.eagle_group_ids if spec_decode.use_eagle else frozenset[int]()
        )
        if spec_decode.use_eagle:
            # Mamba prefill checkpoints follow EAGLE's replay boundary.
            for manager in managers:
                if isinstance(manager, MambaAlignManager):
                    manager.drop_eagle_checkpoint_block = True
        for group_id in self.drop_eagle_group_ids:
            if enable_caching and isinstance(managers[group_id], ChunkedLocalAttentionManager):
                raise ConfigError(
                    f"group {group_id} is chunked local attention: EAGLE's last-block drop is "
                    "not supported there (as in the reference)"
                )
        self.wants_replay_boundaries = self._wants_replay_boundaries()
        # Replay boundaries land on scheduler blocks even where hits may end inside a block
        # (the finer grid would over-estimate how far a resend reaches).
        self.replay_alignment_tokens = managers[0].alignment_tokens if managers else 1
        self.enable_partial_hash_hits = False

    def _wants_replay_boundaries(self) -> bool:
        """Sparse-retention managers with a retention interval keep the blocks at the positions
        a later request can resume at; without one their masks ignore those positions."""
        return any(
            type(manager).reachable_block_mask is not SingleTypeKVCacheManager.reachable_block_mask
            and manager.retention_interval is not None
            for manager in self.single_type_managers
        )

    def set_retention_interval(self, interval: int | None) -> None:
        """Change the sparse-retention interval for what is cached and allocated from now on
        (vLLM's tests set `coordinator.retention_interval` between requests); through
        `KVCacheManager.set_retention_interval`, which also re-picks its fast path. Blocks already
        cached stay as they are. None caches densely; 0 keeps only the tails a hit can resume
        at; N > 0 also one tail per N tokens (a multiple of the scheduler block, else refused
        with `InvalidArgumentError`). Unlike the constructor it does not refuse an interval on
        a model with no sliding-window or Mamba group (it has no effect there), as vLLM's
        attribute takes any."""
        # The construction check's unit: the scheduler block (the groups' block sizes' LCM).
        alignment = lcm(
            self.cache_alignment_tokens,
            *(
                m.block_size
                for m in self.single_type_managers
                if m.kv_cache_spec.covers_token_range
            ),
        )
        if interval is not None and (
            not isinstance(interval, int)
            or isinstance(interval, bool)
            or interval < 0
            or interval % alignment
        ):
            raise InvalidArgumentError(
                f"retention interval must be None, 0 or a positive multiple of {alignment}, "
                f"got {interval!r}"
            )
        self.retention_interval = interval
        for manager in self.single_type_managers:
            manager.retention_interval = interval
        self.wants_replay_boundaries = self._wants_replay_boundaries()

    def _make_managers(
        self, max_model_len: int, max_in_flight_tokens: int, alignment_tokens: int | None
    ) -> tuple[SingleTypeKVCacheManager, ...]:
        """One manager per group, of the class its spec names, all on this pool."""
        config = self.kv_cache_config
        return tuple(
            manager_class_for(group.kv_cache_spec)(
                group.kv_cache_spec,
                self.block_pool,
                group_id,
                enable_caching=self.enable_caching and group.kv_cache_spec.prefix_cacheable,
                max_admission_blocks_per_request=group.kv_cache_spec.max_admission_blocks(
                    max_model_len, max_in_flight_tokens
                ),
                alignment_tokens=alignment_tokens,
                retention_interval=config.prefix_cache_retention_interval,
                record_new_block_ids=config.needs_kv_cache_zeroing
                and isinstance(group.kv_cache_spec, AttentionSpec),
            )
            for group_id, group in enumerate(config.kv_cache_groups)
        )

    # ------------------------------------------------------------------ counting

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlockLists,
        total_computed_tokens: int,
        num_encoder_tokens: int,
        apply_admission_cap: bool = False,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
        num_local_computed_tokens: int = 0,
    ) -> int:
        """`prefill_end`: where the request's prefill ends; only with retention interval 0 do
        Mamba prefill checkpoints wait for the chunk reaching it (as in vLLM 0.33).
        `num_local_computed_tokens`: the prefix hit (a hit ending inside a block needs its
        shared tail copied)."""
        if self.retention_interval != 0:
            prefill_end = 0
        total = 0
        for group_id, manager in enumerate(self.single_type_managers):
            if self._is_cross[group_id]:
                total += manager.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, (), 0, apply_admission_cap
                )
            else:
                total += manager.get_num_blocks_to_allocate(
                    request_id,
                    num_tokens,
                    new_computed_blocks[group_id],
                    total_computed_tokens,
                    apply_admission_cap,
                    num_tokens_main_model,
                    prefill_end,
                    num_local_computed_tokens,
                )
        return total

    # ------------------------------------------------------------------ allocation

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: BlockLists,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> None:
        """Adopt hits in every group, then allocate blocks for external tokens, in two phases.

        Every group touches its hits before any group takes a block from the pool, so one
        group's allocation can never evict another group's not yet adopted hit. A running
        request (already admitted) adopts nothing.
        """
        managers = self.single_type_managers
        if request_id in managers[0].num_cached_block:
            return
        for manager, blocks in zip(managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(
                request_id, blocks, num_local_computed_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens > 0:
            for group_id, manager in enumerate(managers):
                manager.allocate_external_computed_blocks(
                    request_id,
                    num_local_computed_tokens,
                    num_external_computed_tokens,
                    record_for_zeroing=group_id not in skip_zeroing_group_ids,
                )

    def allocate_new_blocks(
        self,
        request_id: str,
        num_tokens: int,
        num_encoder_tokens: int = 0,
        num_tokens_main_model: int | None = None,
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(request_id, num_encoder_tokens)
            if self._is_cross[group_id]
            else manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            for group_id, manager in enumerate(self.single_type_managers)
        )

    def get_num_cacheable_tokens(self, num_computed_tokens: int, group_id: int) -> int:
        """The prefix of `num_computed_tokens` this group may hash now.

        The last `num_reprefillable_tokens` may still be prefilled again (multi-module MTP).
        """
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        boundaries: Sequence[int] = ()
        if self.wants_replay_boundaries:
            boundaries = replay_boundaries(
                request.num_prompt_tokens,
                self.replay_alignment_tokens,
                bool(self.drop_eagle_group_ids),
            )
        for group_id, manager in enumerate(self.single_type_managers):
            if manager.enable_caching:
                manager.cache_blocks(
                    request,
                    self.get_num_cacheable_tokens(num_computed_tokens, group_id),
                    boundaries,
                )

    # ------------------------------------------------------------------ freeing

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free what no group needs any more; `num_prompt_tokens` lets R-SWA free its gap."""
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens, num_prompt_tokens)

    # ------------------------------------------------------------------ reading

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.req_to_blocks.get(request_id) or [] for manager in self.single_type_managers
        )

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return [
            manager.get_num_common_prefix_blocks(running_request_id)
            for manager in self.single_type_managers
        ]

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        return tuple(
            [block.block_id for block in blocks]
            if isinstance(manager.kv_cache_spec, (CrossAttentionSpec, MambaSpec))
            else [
                block.block_id for block in blocks[: cdiv(num_computed_tokens, manager.block_size)]
            ]
            for manager, blocks in zip(
                self.single_type_managers, self.get_blocks(request_id), strict=True
            )
        )

    def estimate_cached_tokens(self, request_id: str) -> int:
        """Min over cacheable groups of the longest prefix a hash of the request's blocks
        covers (0: none)."""
        cached_tokens: int | None = None
        for manager in self.single_type_managers:
            if not manager.enable_caching:
                continue
            group_tokens = 0
            for block in manager.req_to_blocks.get(request_id, ()):
                if block.block_hash is not None and block.hash_num_tokens > group_tokens:
                    group_tokens = block.hash_num_tokens
            if cached_tokens is None or group_tokens < cached_tokens:
                cached_tokens = group_tokens
        return cached_tokens or 0

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        for manager in self.single_type_managers:
            if manager.new_block_ids is None:
                continue
            if start_token % manager.block_size:
                raise InvalidArgumentError(
                    f"start_token {start_token} is not a multiple of group "
                    f"{manager.kv_cache_group_id}'s block size {manager.block_size}"
                )
            blocks = manager.req_to_blocks.get(request_id, ())
            manager.new_block_ids.extend(
                block.block_id for block in blocks[start_token // manager.block_size :]
            )

    def take_new_block_ids(self) -> list[int]:
        ids: list[int] = []
        for manager in self.single_type_managers:
            ids.extend(manager.take_new_block_ids())
        return ids

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Every group's queued `(source, copy)` pairs of sub-block hits, in group order."""
        pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for manager in self.single_type_managers:
            if manager._pending_cow_copies:
                pairs.extend(manager.take_pending_cow_copies())
        return pairs

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        """Hit blocks per group, the hit length, and the uncached common prefix length.

        The last value is how far one group's hit reached past the reconciled hit: a shared
        prefix that a sparse-retention group has not cached (0 with one group).
        """
        raise NotImplementedError

    def check_invariants(self, held_outside: Iterable[KVCacheBlock] = ()) -> None:
        """Check the pool, every manager and the ref counts.

        `held_outside`: blocks the caller still holds outside any block table (popped by
        `pop_blocks_for_free` and not freed yet, or the ends of copies taken and not yet
        released); each occurrence counts as one reference. The ends of queued copies count
        once each too.
        """
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        null_block = self.block_pool.null_block
        queued = [
            block
            for m in self.single_type_managers
            for pair in m._pending_cow_copies
            for block in pair
        ]
        for block in [*held_outside, *queued]:
            if block is not null_block:
                holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for manager in self.single_type_managers:
            manager.check_invariants()
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    if block is not null_block:
                        holders[block.block_id] = holders.get(block.block_id, 0) + 1
        for block in self.block_pool.blocks[1:]:
            expected = holders.get(block.block_id, 0)
            if block.ref_cnt != expected:
                raise InvariantViolation(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {expected} tables"
                )


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Caching disabled (any number of groups): every lookup misses."""

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        return tuple([] for _ in self.single_type_managers), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one group with caching: the hit search is that group's own."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        (self._manager,) = self.single_type_managers
        spec = self._manager.kv_cache_spec
        if spec.block_size != self.hash_block_size:
            raise ConfigError(
                f"one KV-cache group: hash_block_size ({self.hash_block_size}) must equal the "
                f"block size ({spec.block_size})"
            )
        self._group_ids = (0,)
        self._manager.use_eagle = 0 in self.drop_eagle_group_ids

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int, int]:
        manager = self._manager
        blocks, num_tokens = manager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            self._group_ids,
            self.block_pool,
            manager.kv_cache_spec,
            manager.alignment_tokens,
            manager.use_eagle,
        )
        return blocks, num_tokens, 0
