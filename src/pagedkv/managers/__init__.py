"""Per-attention-type managers and the spec → manager dispatch table.

Other attention types register here; the coordinator asks `manager_class_for(spec)` once per
group at construction.
"""

from __future__ import annotations

from pagedkv.errors import ConfigError
from pagedkv.managers.base import SingleTypeKVCacheManager
from pagedkv.managers.chunked_local import ChunkedLocalAttentionManager
from pagedkv.managers.circular_buffer import CircularBufferManager
from pagedkv.managers.cross_attention import CrossAttentionManager
from pagedkv.managers.full_attention import FullAttentionManager
from pagedkv.managers.mamba import MambaManager, MambaNoCacheManager
from pagedkv.managers.mamba_align import MambaAlignManager
from pagedkv.managers.rswa import RSWAManager
from pagedkv.managers.sliding_window import SlidingWindowManager
from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SlidingWindowSpec,
)

_SPEC_TO_MANAGER: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,  # MLAAttentionSpec inherits this entry
    RSWASpec: RSWAManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
    CrossAttentionSpec: CrossAttentionManager,
    CircularBufferSpec: CircularBufferManager,
}


def register_manager(
    spec_class: type[KVCacheSpec], manager_class: type[SingleTypeKVCacheManager]
) -> None:
    """Map a spec class (and its subclasses) to the manager class that serves it."""
    _SPEC_TO_MANAGER[spec_class] = manager_class


# Mamba's cache mode picks the class (one class per mode, not a mode flag in every method).
_MAMBA_MODE_TO_MANAGER: dict[str, type[SingleTypeKVCacheManager]] = {
    "none": MambaNoCacheManager,
    "align": MambaAlignManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for a spec, found along the spec's MRO (Mamba: by cache mode)."""
    for klass in type(spec).__mro__:
        manager = _SPEC_TO_MANAGER.get(klass)
        if manager is MambaManager and isinstance(spec, MambaSpec):
            return _MAMBA_MODE_TO_MANAGER[spec.mamba_cache_mode]
        if manager is not None:
            return manager
    raise ConfigError(f"no KV-cache manager is registered for {type(spec).__name__}")


__all__ = [
    "ChunkedLocalAttentionManager",
    "CircularBufferManager",
    "CrossAttentionManager",
    "FullAttentionManager",
    "MambaAlignManager",
    "MambaManager",
    "MambaNoCacheManager",
    "RSWAManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "manager_class_for",
    "register_manager",
]
