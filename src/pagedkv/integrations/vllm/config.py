"""vLLM's `KVCacheConfig` translated to pagedkv's: groups, block sizes and the attention types.

Each vLLM spec maps to the pagedkv spec whose manager behaves as vLLM's manager for it. A spec
pagedkv does not implement is refused here, at construction, with the reason.
"""

from __future__ import annotations

import torch
from vllm.v1.core.kv_cache_coordinator import (
    _validate_prefix_cache_retention_interval as vllm_validate_retention_interval,
)
from vllm.v1.kv_cache_interface import AttentionSpec as VllmAttentionSpec
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec as VllmChunkedLocalSpec
from vllm.v1.kv_cache_interface import CircularBufferSpec as VllmCircularBufferSpec
from vllm.v1.kv_cache_interface import CrossAttentionSpec as VllmCrossAttentionSpec
from vllm.v1.kv_cache_interface import FullAttentionSpec as VllmFullAttentionSpec
from vllm.v1.kv_cache_interface import KVCacheConfig as VllmKVCacheConfig
from vllm.v1.kv_cache_interface import KVCacheSpec as VllmKVCacheSpec
from vllm.v1.kv_cache_interface import MambaSpec as VllmMambaSpec
from vllm.v1.kv_cache_interface import MLAAttentionSpec as VllmMLASpec
from vllm.v1.kv_cache_interface import RSWASpec as VllmRSWASpec
from vllm.v1.kv_cache_interface import SlidingWindowSpec as VllmSlidingWindowSpec
from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

from pagedkv.errors import ConfigError
from pagedkv.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    ReplayedSlidingWindowSpec,
    RSWASpec,
    SlidingWindowSpec,
)

# vLLM specs whose manager pagedkv does not implement, with the reason given to the user.
_UNSUPPORTED_NAMES = {
    "HiSparseHotSpec": "HiSparse host-tier groups",
    "HiSparseResidentSpec": "HiSparse host-tier groups",
    "EncoderOnlyAttentionSpec": "encoder-only attention groups",
}


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _attention_fields(spec: VllmAttentionSpec) -> dict:
    """The fields pagedkv's attention specs share, with vLLM's page size kept when it fits."""
    return {
        "block_size": spec.block_size,
        "num_kv_heads": spec.num_kv_heads,
        "head_size": spec.head_size,
        "dtype_bytes": _dtype_bytes(spec.dtype),
        "head_size_v": spec.head_size_v,
        "dcp_sharded": spec.dcp_sharded,
    }


def _with_page_size(spec: KVCacheSpec, page_size_bytes: int) -> KVCacheSpec:
    """Carry vLLM's page size over when pagedkv's own formula does not exceed it.

    Page sizes are informational for the manager (it counts blocks, not bytes).
    """
    real = getattr(spec, "real_page_size_bytes", None)
    if real is None or page_size_bytes == real or page_size_bytes < real:
        return spec
    return type(spec)(**{**spec.__dict__, "page_size_padded": page_size_bytes})


def translate_spec(spec: VllmKVCacheSpec) -> KVCacheSpec:
    """pagedkv's spec for one vLLM spec; `ConfigError` for attention types pagedkv lacks."""
    name = type(spec).__name__
    if name in _UNSUPPORTED_NAMES:
        raise ConfigError(f"pagedkv does not implement {_UNSUPPORTED_NAMES[name]} ({name})")
    if isinstance(spec, UniformTypeKVCacheSpecs):
        # The scheduler's config carries one member spec per group; a uniform-type group
        # manages blocks exactly as its members do.
        return translate_spec(next(iter(spec.kv_cache_specs.values())))
    if spec.prefix_replay_tokens and not (
        isinstance(spec, VllmSlidingWindowSpec) and spec.prefix_replay_tokens == spec.sliding_window
    ):
        raise ConfigError(
            f"pagedkv implements bounded prefix replay for sliding windows only ({name})"
        )
    translated: KVCacheSpec
    if isinstance(spec, VllmMambaSpec):
        # vLLM pairs shapes with dtypes (zip): a shape without a dtype takes no bytes. A flat
        # entry (`shapes=(1, 1)`, as vLLM's tests write it) is a one-dimensional shape.
        pairs = list(zip(spec.shapes, spec.dtypes, strict=False))
        translated = MambaSpec(
            spec.block_size,
            tuple((shape,) if isinstance(shape, int) else tuple(shape) for shape, _ in pairs),
            tuple(_dtype_bytes(dtype) for _, dtype in pairs),
            mamba_cache_mode=spec.mamba_cache_mode,
            num_speculative_blocks=spec.num_speculative_blocks,
            num_prefill_checkpoint_blocks=spec.num_prefill_checkpoint_blocks,
            prefill_checkpoint_alignment=spec.prefill_checkpoint_alignment,
        )
        if spec.page_size_padded is None:
            # vLLM's own page_size_bytes raises TypeError on a flat shape; pagedkv's is the
            # same sum with the flat entry as a one-dimensional shape.
            return translated
    elif isinstance(spec, VllmSlidingWindowSpec):
        # Bounded replay (vLLM's SlidingWindowMLASpec(bounded_replay=True)): a window whose
        # blocks are never cached; vLLM's scheduler recomputes it after a hit.
        window_class = ReplayedSlidingWindowSpec if spec.prefix_replay_tokens else SlidingWindowSpec
        translated = window_class(
            **_attention_fields(spec),
            sliding_window=spec.sliding_window,
            extra_retained_tokens=spec.extra_retained_tokens,
        )
    elif isinstance(spec, VllmCircularBufferSpec):
        translated = CircularBufferSpec(**_attention_fields(spec))
    elif isinstance(spec, VllmChunkedLocalSpec):
        translated = ChunkedLocalAttentionSpec(
            **_attention_fields(spec), attention_chunk_size=spec.attention_chunk_size
        )
    elif isinstance(spec, VllmCrossAttentionSpec):
        translated = CrossAttentionSpec(**_attention_fields(spec))
    elif isinstance(spec, VllmRSWASpec):
        translated = RSWASpec(
            **_attention_fields(spec),
            sliding_window=spec.sliding_window,
            attention_chunk_size=spec.attention_chunk_size,
            rswa_window=spec.rswa_window,
        )
    elif isinstance(spec, VllmMLASpec):
        fields = _attention_fields(spec)
        del fields["head_size_v"]
        translated = MLAAttentionSpec(**fields)
    elif isinstance(spec, VllmFullAttentionSpec):
        translated = FullAttentionSpec(
            **_attention_fields(spec),
            sliding_window=spec.sliding_window,
            attention_chunk_size=spec.attention_chunk_size,
        )
    else:
        raise ConfigError(f"pagedkv has no KV-cache manager for vLLM's {name}")
    page_size_bytes = (
        spec.page_size_padded if isinstance(spec, VllmMambaSpec) else spec.page_size_bytes
    )
    return _with_page_size(translated, page_size_bytes)


def as_vllm_int(value: int | bool) -> int:
    """vLLM's meaning of a count given as a bool (its manager uses it as 0 or 1)."""
    return int(value) if isinstance(value, bool) else value


def check_as_vllm(
    config: VllmKVCacheConfig,
    scheduler_block_size: int,
    hash_block_size: int,
    enable_caching: bool,
    use_eagle: bool,
    num_prefill_lookahead: int,
    watermark: float,
) -> None:
    """Refuse what vLLM 0.33's `KVCacheManager` refuses, with its error types and messages.

    Runs before the translation (pagedkv's own checks word the same faults differently, and
    would refuse some first), in the order vLLM's constructor meets them.
    """
    groups = config.kv_cache_groups
    # vLLM asserts the block-size lattice (an AssertionError, no message).
    assert scheduler_block_size % hash_block_size == 0 and all(
        scheduler_block_size % group.kv_cache_spec.block_size == 0 for group in groups
    )
    eagle_groups = use_eagle or any(group.is_eagle_group for group in groups)
    if enable_caching and eagle_groups and scheduler_block_size < num_prefill_lookahead:
        raise ValueError(
            f"Multi-module MTP with prefix caching requires scheduler_block_size"
            f" (={scheduler_block_size}) >= num_speculative_tokens"
            f" (={num_prefill_lookahead})."
        )
    # vLLM's own check, so its messages are the drop-in's word for word.
    vllm_validate_retention_interval(
        config.prefix_cache_retention_interval, scheduler_block_size, config
    )
    assert watermark >= 0.0, "watermark must be non-negative"


def translate_config(config: VllmKVCacheConfig) -> KVCacheConfig:
    """pagedkv's `KVCacheConfig` for vLLM's (same block count, groups in the same order)."""
    for group_id, group in enumerate(config.kv_cache_groups):
        if group.host_resident:
            raise ConfigError(f"group {group_id} is host-resident (HiSparse); not implemented")
    return KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_groups=tuple(
            KVCacheGroupSpec(
                tuple(group.layer_names),
                translate_spec(group.kv_cache_spec),
                is_eagle_group=group.is_eagle_group,
            )
            for group in config.kv_cache_groups
        ),
        prefix_cache_retention_interval=config.prefix_cache_retention_interval,
        needs_kv_cache_zeroing=config.needs_kv_cache_zeroing,
    )
