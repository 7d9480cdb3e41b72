"""Read views that show pagedkv's coordinator, managers and pool in the shapes vLLM code reads.

vLLM's scheduler (and its tests) reach past the manager facade: `coordinator.single_type_managers`
with vLLM specs, `coordinator.get_num_blocks_to_allocate` with vLLM's keywords,
`block_pool.cached_block_hash_to_block`. These views answer from pagedkv's live state; every
other attribute is forwarded unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.core import kv_cache_coordinator as vllm_coordinators
from vllm.v1.core import single_type_kv_cache_manager as vllm_stm
from vllm.v1.kv_cache_interface import KVCacheSpec as VllmKVCacheSpec

from pagedkv import managers as pagedkv_managers
from pagedkv.block import KVCacheBlock, make_block_hash_with_group_id
from pagedkv.block_pool import BlockPool
from pagedkv.coordinators import (
    HybridKVCacheCoordinator,
    KVCacheCoordinator,
    UnitaryKVCacheCoordinator,
)
from pagedkv.managers import SingleTypeKVCacheManager


class ManagerView:
    """One group's manager, with vLLM's spec as `kv_cache_spec` (the scheduler tests its type).

    Each subclass below is registered as a virtual subclass of the vLLM manager class it
    stands for, so vLLM code that asks `isinstance(manager, CrossAttentionManager)` gets the
    right answer.
    """

    def __init__(self, manager: SingleTypeKVCacheManager, vllm_spec: VllmKVCacheSpec) -> None:
        self._manager = manager
        self.kv_cache_spec = vllm_spec
        self.block_size = manager.block_size
        self.kv_cache_group_id = manager.kv_cache_group_id

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)


def _view_class(vllm_class: type) -> type[ManagerView]:
    view = type(f"{vllm_class.__name__}View", (ManagerView,), {})
    vllm_class.register(view)  # type: ignore[attr-defined]  # vLLM's managers are ABCs
    return view


# pagedkv manager class -> view class; subclasses first (the lookup walks this order).
_MANAGER_VIEWS: tuple[tuple[type, type[ManagerView]], ...] = (
    (pagedkv_managers.FullAttentionManager, _view_class(vllm_stm.FullAttentionManager)),
    (pagedkv_managers.SlidingWindowManager, _view_class(vllm_stm.SlidingWindowManager)),
    (
        pagedkv_managers.ChunkedLocalAttentionManager,
        _view_class(vllm_stm.ChunkedLocalAttentionManager),
    ),
    (pagedkv_managers.MambaManager, _view_class(vllm_stm.MambaManager)),
    (pagedkv_managers.CrossAttentionManager, _view_class(vllm_stm.CrossAttentionManager)),
)


def manager_view(manager: SingleTypeKVCacheManager, vllm_spec: VllmKVCacheSpec) -> ManagerView:
    for pagedkv_class, view_class in _MANAGER_VIEWS:
        if isinstance(manager, pagedkv_class):
            return view_class(manager, vllm_spec)
    return ManagerView(manager, vllm_spec)


class CoordinatorView:
    """The coordinator with vLLM 0.33's keyword signatures and attributes.

    `for_coordinator` picks the subclass registered as the matching vLLM coordinator class.
    """

    # pagedkv has no sub-block (partial) hash hits.
    enable_partial_hash_hits = False

    def __init__(
        self, coordinator: KVCacheCoordinator, vllm_specs: Sequence[VllmKVCacheSpec]
    ) -> None:
        self._coordinator = coordinator
        self.single_type_managers = tuple(
            manager_view(manager, spec)
            for manager, spec in zip(coordinator.single_type_managers, vllm_specs, strict=True)
        )

    @staticmethod
    def for_coordinator(
        coordinator: KVCacheCoordinator, vllm_specs: Sequence[VllmKVCacheSpec]
    ) -> CoordinatorView:
        if isinstance(coordinator, HybridKVCacheCoordinator):
            return HybridCoordinatorView(coordinator, vllm_specs)
        if isinstance(coordinator, UnitaryKVCacheCoordinator):
            return UnitaryCoordinatorView(coordinator, vllm_specs)
        return NoPrefixCacheCoordinatorView(coordinator, vllm_specs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._coordinator, name)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: tuple[Sequence[KVCacheBlock], ...],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        return self._coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_encoder_tokens,
            apply_admission_cap,
            num_tokens_main_model,
            prefill_end,
        )


class HybridCoordinatorView(CoordinatorView):
    """Stands for vLLM's `HybridKVCacheCoordinator`."""


class UnitaryCoordinatorView(CoordinatorView):
    """Stands for vLLM's `UnitaryKVCacheCoordinator`."""


class NoPrefixCacheCoordinatorView(CoordinatorView):
    """Stands for vLLM's `KVCacheCoordinatorNoPrefixCache`."""


vllm_coordinators.HybridKVCacheCoordinator.register(HybridCoordinatorView)
vllm_coordinators.UnitaryKVCacheCoordinator.register(UnitaryCoordinatorView)
vllm_coordinators.KVCacheCoordinatorNoPrefixCache.register(NoPrefixCacheCoordinatorView)


class CachedBlockMapView:
    """vLLM's `BlockHashToBlockMap` shape over pagedkv's per-group hash maps (read only).

    Keys are the reference's `hash + 4-byte group id`; a value is the block, or a dict
    `block_id -> block` when several blocks hold the hash (`_cache` is vLLM's field name).
    """

    def __init__(self, block_pool: BlockPool) -> None:
        self._block_pool = block_pool

    @property
    def _cache(self) -> dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]]:
        cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}
        for group_id in range(self._block_pool.num_kv_cache_groups):
            for block_hash, block_ids in self._block_pool.cached_hashes(group_id).items():
                blocks = {block_id: self._block_pool.blocks[block_id] for block_id in block_ids}
                key = make_block_hash_with_group_id(block_hash, group_id)
                cache[key] = blocks[block_ids[0]] if len(blocks) == 1 else blocks
        return cache

    def __len__(self) -> int:
        return sum(len(hash_map) for hash_map in self._block_pool.hash_to_block)

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        value = self._cache.get(key)
        if isinstance(value, dict):
            return next(iter(value.values()))
        return value


class BlockPoolView:
    """The pool, plus vLLM's `cached_block_hash_to_block`; everything else is pagedkv's."""

    def __init__(self, block_pool: BlockPool) -> None:
        self._block_pool = block_pool
        self.cached_block_hash_to_block = CachedBlockMapView(block_pool)
        # Bound methods the scheduler calls, without a __getattr__ hop.
        self.free_blocks = block_pool.free_blocks
        self.get_num_free_blocks = block_pool.get_num_free_blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block_pool, name)
