"""Memory sizing (stdlib): a model's config read into per-layer specs, and the planner that turns
them and a byte budget into a `KVCacheConfig`.

`model_config`: Hugging Face `config.json` -> one KV-cache spec per layer (knows model families).
`planner`: page-size unification, grouping, `num_blocks`, concurrency, longest fitting length.
"""

from __future__ import annotations

from pagedkv.sizing.model_config import (
    DTYPE_TO_BYTES,
    ModelDescription,
    describe_model,
    get_dtype_bytes,
    load_model_description,
    shipped_config_names,
)
from pagedkv.sizing.planner import (
    GIB_BYTES,
    KVCacheLayout,
    SizingResult,
    check_enough_memory,
    estimate_max_model_len,
    format_gib,
    get_kv_cache_config,
    get_kv_cache_layout,
    get_max_concurrency,
    get_num_blocks,
    promote_local_attention,
    size_kv_cache,
    unify_page_sizes,
)

__all__ = [
    "DTYPE_TO_BYTES",
    "GIB_BYTES",
    "KVCacheLayout",
    "ModelDescription",
    "SizingResult",
    "check_enough_memory",
    "describe_model",
    "estimate_max_model_len",
    "format_gib",
    "get_dtype_bytes",
    "get_kv_cache_config",
    "get_kv_cache_layout",
    "get_max_concurrency",
    "get_num_blocks",
    "load_model_description",
    "promote_local_attention",
    "shipped_config_names",
    "size_kv_cache",
    "unify_page_sizes",
]
