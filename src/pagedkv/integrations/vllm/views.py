"""Read views that show pagedkv's coordinator, managers and pool in the shapes vLLM code reads.

vLLM's scheduler (and its tests) reach past the manager facade: `coordinator.single_type_managers`
with vLLM specs, `coordinator.get_num_blocks_to_allocate` with vLLM's keywords,
`block_pool.cached_block_hash_to_block`. These views answer from pagedkv's live state; every
other attribute is forwarded unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

from vllm.v1.core import kv_cache_coordinator as vllm_coordinators
from vllm.v1.core import single_type_kv_cache_manager as vllm_stm
from vllm.v1.kv_cache_interface import KVCacheSpec as VllmKVCacheSpec
from vllm.v1.request import Request as VllmRequest

from pagedkv import coordinators as pagedkv_coordinators
from pagedkv import managers as pagedkv_managers
from pagedkv.block import (
    BlockHash,
    BlockHashWithGroupId,
    KVCacheBlock,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from pagedkv.block_pool import BlockPool
from pagedkv.coordinators import KVCacheCoordinator
from pagedkv.hashing import resolve_block_hashes
from pagedkv.integrations.vllm.requests import sync_view
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

    def __setattr__(self, name: str, value: Any) -> None:
        # The view's own attributes stay here; anything else a caller sets (vLLM's tests set
        # `use_eagle`, or wrap `cache_blocks` in a spy) is set on the manager, which acts on it.
        if name in _VIEW_ATTRIBUTES:
            object.__setattr__(self, name, value)
        else:
            setattr(self._manager, name, value)


_VIEW_ATTRIBUTES = frozenset({"_manager", "kv_cache_spec", "block_size", "kv_cache_group_id"})


def _view_class(vllm_class: type) -> type[ManagerView]:
    # vLLM's class name: code that reports or compares `type(manager).__name__` sees vLLM's.
    view = type(vllm_class.__name__, (ManagerView,), {})
    vllm_class.register(view)  # type: ignore[attr-defined]  # vLLM's managers are ABCs
    return view


# pagedkv manager class -> view class; subclasses first (the lookup walks this order).
_MANAGER_VIEWS: tuple[tuple[type, type[ManagerView]], ...] = (
    (pagedkv_managers.CircularBufferManager, _view_class(vllm_stm.CircularBufferManager)),
    (pagedkv_managers.RSWAManager, _view_class(vllm_stm.RSWAManager)),
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

    def __init__(
        self,
        coordinator: KVCacheCoordinator,
        vllm_specs: Sequence[VllmKVCacheSpec],
        scheduler_block_size: int,
        set_retention_interval: Callable[[int | None], None] | None = None,
    ) -> None:
        self._coordinator = coordinator
        self._vllm_specs = tuple(vllm_specs)
        # Where `retention_interval = N` goes: the owner's setter (the drop-in's also re-picks
        # the core's fast path), else the coordinator's own.
        self._set_retention_interval = set_retention_interval or coordinator.set_retention_interval
        self.scheduler_block_size = scheduler_block_size
        self.single_type_managers = tuple(
            manager_view(manager, spec)
            for manager, spec in zip(coordinator.single_type_managers, vllm_specs, strict=True)
        )

    @property
    def retention_interval(self) -> int | None:
        """vLLM's name: None caches densely, 0 keeps only the replay tails, N > 0 one per N;
        set, it reaches every group's manager (`set_retention_interval`)."""
        return self._coordinator.retention_interval

    @retention_interval.setter
    def retention_interval(self, interval: int | None) -> None:
        self._set_retention_interval(interval)

    @staticmethod
    def for_coordinator(
        coordinator: KVCacheCoordinator,
        vllm_specs: Sequence[VllmKVCacheSpec],
        scheduler_block_size: int,
        set_retention_interval: Callable[[int | None], None] | None = None,
    ) -> CoordinatorView:
        view_class: type[CoordinatorView] = KVCacheCoordinatorNoPrefixCache
        if isinstance(coordinator, pagedkv_coordinators.HybridKVCacheCoordinator):
            view_class = HybridKVCacheCoordinator
        elif isinstance(coordinator, pagedkv_coordinators.UnitaryKVCacheCoordinator):
            view_class = UnitaryKVCacheCoordinator
        return view_class(coordinator, vllm_specs, scheduler_block_size, set_retention_interval)

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
            num_local_computed_tokens,
        )


# Named as the vLLM classes they stand for (vLLM's tests read `type(coordinator).__name__`).
class HybridKVCacheCoordinator(CoordinatorView):
    """Stands for vLLM's `HybridKVCacheCoordinator`."""

    @property
    def attention_groups(self) -> list[vllm_coordinators.SpecGroup]:
        """vLLM's lookup buckets (cacheable groups by spec, full attention first), from
        pagedkv's `spec_buckets`, which are built by the same rule."""
        coordinator = self._coordinator
        assert isinstance(coordinator, pagedkv_coordinators.HybridKVCacheCoordinator)
        return [
            vllm_coordinators.SpecGroup(
                self._vllm_specs[bucket.group_ids[0]],
                list(bucket.group_ids),
                type(self.single_type_managers[bucket.group_ids[0]]),
                bucket.use_eagle,
            )
            for bucket in coordinator.spec_buckets
        ]

    @property
    def _cache_hit_alignment_tokens(self) -> int:
        """Hits land on hash blocks with sub-block hash hits, else on scheduler blocks."""
        if self.enable_partial_hash_hits:
            return self._coordinator.hash_block_size
        return self.scheduler_block_size


class UnitaryKVCacheCoordinator(CoordinatorView):
    """Stands for vLLM's `UnitaryKVCacheCoordinator`."""


class KVCacheCoordinatorNoPrefixCache(CoordinatorView):
    """Stands for vLLM's `KVCacheCoordinatorNoPrefixCache`."""


vllm_coordinators.HybridKVCacheCoordinator.register(HybridKVCacheCoordinator)
vllm_coordinators.UnitaryKVCacheCoordinator.register(UnitaryKVCacheCoordinator)
vllm_coordinators.KVCacheCoordinatorNoPrefixCache.register(KVCacheCoordinatorNoPrefixCache)


class BlockView:
    """One of the pool's blocks as vLLM's `KVCacheBlock` reads: `block_hash` (and
    `_block_hash`) in vLLM's hash + 4-byte group id form; every other attribute, read or
    written, is the block's own.

    Equal to the block it shows (and hashes as it), so comparisons with the blocks of
    `KVCacheBlocks` results hold; `is` does not.
    """

    __slots__ = ("_block",)

    def __init__(self, block: KVCacheBlock) -> None:
        object.__setattr__(self, "_block", block)

    @property
    def block_hash(self) -> bytes | None:
        block = self._block
        if block.block_hash is None:
            return None
        return make_block_hash_with_group_id(block.block_hash, block.hash_group_id)

    _block_hash = block_hash

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._block, name, value)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockView):
            other = other._block
        return self._block is other

    def __hash__(self) -> int:
        return hash(self._block)

    def __repr__(self) -> str:
        return repr(self._block)


def unwrap_block(block: KVCacheBlock | BlockView) -> KVCacheBlock:
    """The pool's block behind a `BlockView` (a block is returned as it is)."""
    return block._block if isinstance(block, BlockView) else block


class BlockListView(Sequence[BlockView]):
    """`block_pool.blocks`: the pool's blocks, each as a `BlockView` (built on access)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._blocks = blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [BlockView(block) for block in self._blocks[index]]
        return BlockView(self._blocks[index])

    def __iter__(self) -> Iterator[BlockView]:
        return (BlockView(block) for block in self._blocks)


def _split_key(key: bytes) -> tuple[BlockHash, int]:
    if not isinstance(key, bytes) or len(key) <= 4:
        raise KeyError(key)
    return get_block_hash(BlockHashWithGroupId(key)), get_group_id(BlockHashWithGroupId(key))


class CachedBlocksMapping(MutableMapping[bytes, "KVCacheBlock | dict[int, KVCacheBlock]"]):
    """vLLM's `BlockHashToBlockMap._cache`, live over pagedkv's per-group hash maps.

    A key is vLLM's `hash + 4-byte group id`; a value is the block, or `block_id -> block`
    when several blocks hold the key. Writes are applied to the pool: deleting a key takes its
    blocks out of the prefix cache (their hash is forgotten, no event, as vLLM's map edit
    sends none); setting one enters the given unhashed blocks under it. `copy.copy` gives a
    plain-dict snapshot.
    """

    def __init__(self, block_pool: BlockPool) -> None:
        self._block_pool = block_pool

    def _group_ids(self) -> range:
        return range(self._block_pool.num_kv_cache_groups)

    def __getitem__(self, key: bytes) -> KVCacheBlock | dict[int, KVCacheBlock]:
        block_hash, group_id = _split_key(key)
        if group_id not in self._group_ids():
            raise KeyError(key)
        blocks = self._block_pool.get_cached_blocks(block_hash, group_id)
        if not blocks:
            raise KeyError(key)
        return blocks[0] if len(blocks) == 1 else {block.block_id: block for block in blocks}

    def __setitem__(self, key: bytes, value: KVCacheBlock | dict[int, KVCacheBlock]) -> None:
        block_hash, group_id = _split_key(key)
        blocks = list(value.values()) if isinstance(value, dict) else [value]
        for block in blocks:
            self._block_pool.add_cache_entry(unwrap_block(block), block_hash, group_id)

    def __delitem__(self, key: bytes) -> None:
        value = self[key]
        blocks = list(value.values()) if isinstance(value, dict) else [value]
        for block in blocks:
            self._block_pool.drop_cache_entry(block)

    def __iter__(self) -> Iterator[bytes]:
        for group_id in self._group_ids():
            # A snapshot of the keys: callers may delete while iterating.
            for block_hash in list(self._block_pool.hash_to_block[group_id]):
                yield make_block_hash_with_group_id(block_hash, group_id)

    def __len__(self) -> int:
        return sum(len(hash_map) for hash_map in self._block_pool.hash_to_block)

    def __copy__(self) -> dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]]:
        return dict(self.items())


class CachedBlockMapView:
    """vLLM's `BlockHashToBlockMap` over pagedkv's per-group hash maps; edits are applied."""

    def __init__(self, block_pool: BlockPool) -> None:
        self._cache = CachedBlocksMapping(block_pool)

    def __len__(self) -> int:
        return len(self._cache)

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        value = self._cache.get(key)
        if isinstance(value, dict):
            return next(iter(value.values()))
        return value

    def contain(self, key: bytes, block_id: int) -> bool:
        value = self._cache.get(key)
        if value is None:
            return False
        if isinstance(value, dict):
            return block_id in value
        return value.block_id == block_id

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        """Enter an unhashed block of this pool under `key`."""
        self._cache[key] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Take block `block_id` out of the cache under `key`; None if it is not there."""
        value = self._cache.get(key)
        if value is None:
            return None
        block = value.get(block_id) if isinstance(value, dict) else value
        if block is None or block.block_id != block_id:
            return None
        self._cache._block_pool.drop_cache_entry(block)
        return block


class BlockPoolView:
    """The pool in vLLM's shapes: `blocks` (as `BlockView`s), `cached_block_hash_to_block`,
    `cache_full_blocks` with vLLM's signature; everything else is pagedkv's."""

    def __init__(self, block_pool: BlockPool) -> None:
        self._block_pool = block_pool
        self.blocks = BlockListView(block_pool.blocks)
        self.cached_block_hash_to_block = CachedBlockMapView(block_pool)
        # Bound methods the scheduler calls, without a __getattr__ hop.
        self.free_blocks = block_pool.free_blocks
        self.get_num_free_blocks = block_pool.get_num_free_blocks

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block_pool, name)

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[BlockView] | None:
        """vLLM's lookup: the first block under the hash in each group (as `BlockView`s)."""
        blocks = self._block_pool.get_cached_block(block_hash, kv_cache_group_ids)
        return None if blocks is None else [BlockView(block) for block in blocks]

    def cache_full_blocks(
        self,
        request: VllmRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        """vLLM's `BlockPool.cache_full_blocks`: the hashes come from the request."""
        pool = self._block_pool
        view = sync_view(request, pool.hash_block_size)
        pool.cache_full_blocks(
            view,
            [unwrap_block(block) for block in blocks],
            resolve_block_hashes(view.block_hashes, pool.hash_block_size, block_size),
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
