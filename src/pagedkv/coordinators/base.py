"""Coordinator: builds the pool and one manager per KV-cache group, fans calls out to groups,
and finds the prefix hit valid in every group. `pagedkv.coordinators.make_coordinator` picks one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool, BlockResidencyObserver
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.eviction import EvictionConfig
from pagedkv.managers import SingleTypeKVCacheManager, manager_class_for
from pagedkv.specs import CrossAttentionSpec, KVCacheConfig

if TYPE_CHECKING:
    from pagedkv.request import Request

BlockLists = tuple[Sequence[KVCacheBlock], ...]


class KVCacheCoordinator:
    """Fans manager calls out to every group; subclasses differ only in the hit search.

    Invariant (`check_invariants`): every block's `ref_cnt` equals the number of block tables,
    across all groups, that hold it. `cache_blocks(request, n)` caches every caching group's
    full blocks up to `n` rounded down to a multiple of `cache_alignment_tokens`.
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
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.hash_block_size = hash_block_size
        self.enable_caching = enable_caching
        groups = kv_cache_config.kv_cache_groups
        self.block_pool = BlockPool(
            kv_cache_config.num_blocks,
            enable_caching=enable_caching,
            hash_block_size=hash_block_size,
            num_kv_cache_groups=max(len(groups), 1),
            enable_kv_cache_events=enable_kv_cache_events,
            metrics_collector=metrics_collector,
            eviction=eviction,
        )
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        managers = []
        for group_id, group in enumerate(groups):
            spec = group.kv_cache_spec
            managers.append(
                manager_class_for(spec)(
                    spec,
                    self.block_pool,
                    group_id,
                    enable_caching=enable_caching and spec.prefix_cacheable,
                    max_admission_blocks_per_request=spec.max_admission_blocks(
                        max_model_len, in_flight
                    ),
                    alignment_tokens=alignment_tokens,
                )
            )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(managers)
        self._is_cross = tuple(isinstance(g.kv_cache_spec, CrossAttentionSpec) for g in groups)

    # ------------------------------------------------------------------ counting

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlockLists,
        total_computed_tokens: int,
        num_encoder_tokens: int,
        apply_admission_cap: bool = False,
    ) -> int:
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
                )
        return total

    # ------------------------------------------------------------------ allocation

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: BlockLists, total_computed_tokens: int
    ) -> None:
        """Adopt hits in every group, then pad skipped positions, in two phases.

        Every group touches its hits before any group takes a block from the pool, so one
        group's allocation can never evict another group's not yet adopted hit.
        """
        managers = self.single_type_managers
        for manager, blocks in zip(managers, new_computed_blocks, strict=True):
            manager.add_local_computed_blocks(request_id, blocks, total_computed_tokens)
        for manager in managers:
            manager.allocate_external_computed_blocks(request_id, total_computed_tokens)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_encoder_tokens: int = 0
    ) -> tuple[list[KVCacheBlock], ...]:
        return tuple(
            manager.allocate_new_blocks(
                request_id, num_encoder_tokens if self._is_cross[group_id] else num_tokens
            )
            for group_id, manager in enumerate(self.single_type_managers)
        )

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            if manager.enable_caching:
                manager.cache_blocks(request, num_computed_tokens)

    # ------------------------------------------------------------------ freeing

    def free(self, request_id: str) -> None:
        for manager in self.single_type_managers:
            manager.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        blocks: list[KVCacheBlock] = []
        for manager in self.single_type_managers:
            blocks.extend(manager.pop_blocks_for_free(request_id))
        return blocks

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self.single_type_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

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

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        raise NotImplementedError

    def check_invariants(self, held_outside: Iterable[KVCacheBlock] = ()) -> None:
        """Check the pool, every manager and the ref counts.

        `held_outside`: blocks the caller still holds outside any block table (popped by
        `pop_blocks_for_free` and not freed yet); each occurrence counts as one reference.
        """
        self.block_pool.check_invariants()
        holders: dict[int, int] = {}
        null_block = self.block_pool.null_block
        for block in held_outside:
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
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        return tuple([] for _ in self.single_type_managers), 0


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

    def find_longest_cache_hit(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        manager = self._manager
        return manager.find_longest_cache_hit(
            block_hashes,
            max_cache_hit_length,
            self._group_ids,
            self.block_pool,
            manager.kv_cache_spec,
            manager.alignment_tokens,
        )
