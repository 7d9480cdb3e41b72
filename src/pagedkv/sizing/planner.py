"""Sizing planner: turns per-layer specs and a byte budget into a `KVCacheConfig`.

Owns page-size unification, grouping layers into KV-cache groups, `num_blocks` (null block
reserved), max concurrency and the longest `max_model_len` that fits. Knows nothing of managers,
torch or config files (`pagedkv.sizing.model_config` builds the per-layer specs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType

from pagedkv.errors import ConfigError, InvalidArgumentError, NotEnoughMemoryError
from pagedkv.specs import (
    AttentionSpec,
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    cdiv,
)

GIB_BYTES = 1 << 30


def format_gib(num_bytes: int) -> float:
    """Bytes as GiB rounded to two decimals (how the reference reports memory)."""
    return round(num_bytes / GIB_BYTES, 2)


def _blocks_per_request(
    groups: tuple[KVCacheGroupSpec, ...],
    max_model_len: int,
    max_in_flight_tokens: int | None,
    max_num_encoder_input_tokens: int,
) -> tuple[int, ...]:
    """Worst-case blocks one request holds in each group (per-spec bytes over page bytes)."""
    counts = []
    for group in groups:
        spec = group.kv_cache_spec
        num_bytes = spec.max_memory_usage_bytes(
            max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens
        )
        counts.append(cdiv(num_bytes, spec.page_size_bytes))
    return tuple(counts)


@dataclass(frozen=True)
class KVCacheLayout:
    """A model's layers placed into KV-cache groups that draw block ids from one pool.

    Invariants: every layer of `layer_to_spec` is in exactly one group; a group's layers share
    its block table; when there is more than one group, every layer's page has the same size
    (so one block id means the same number of bytes in every group). `groups[g].kv_cache_spec`
    is what the group's manager sees: for a uniform-type group whose layers differ only in head
    count or size, it is the first layer's spec (block size, type and window are common to all;
    the per-layer page sizes live in `layer_to_spec`).
    """

    groups: tuple[KVCacheGroupSpec, ...]
    layer_to_spec: Mapping[str, KVCacheSpec]

    def group_page_size_bytes(self, group_id: int) -> int:
        """Bytes one block id occupies across the layers of group `group_id`."""
        layer_to_spec = self.layer_to_spec
        return sum(
            layer_to_spec[name].page_size_bytes for name in self.groups[group_id].layer_names
        )

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id costs: the largest group's page total (groups alias the bytes)."""
        return max((self.group_page_size_bytes(g) for g in range(len(self.groups))), default=0)

    def blocks_per_request(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> tuple[int, ...]:
        """Worst-case blocks one request holds in each group."""
        return _blocks_per_request(
            self.groups, max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens
        )

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        """Worst-case bytes one request needs: `bytes_per_block × Σ blocks per group`."""
        num_blocks = sum(
            self.blocks_per_request(
                max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens
            )
        )
        return self.bytes_per_block * num_blocks


# --------------------------------------------------------------------------- spec rewriting


def promote_local_attention(layer_to_spec: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Manage sliding-window and chunked-local layers as full attention (hybrid manager off).

    The window stays on the spec (`sliding_window` / `attention_chunk_size`) for compute;
    allocation becomes full. A model whose layers are all of one kind is returned unchanged.
    Raises `ConfigError` if other kinds (Mamba, cross-attention) keep the model hybrid.
    """
    if len({type(spec) for spec in layer_to_spec.values()}) <= 1:
        return dict(layer_to_spec)
    promoted: dict[str, KVCacheSpec] = {}
    for name, spec in layer_to_spec.items():
        if isinstance(spec, SlidingWindowSpec | ChunkedLocalAttentionSpec):
            spec = FullAttentionSpec(
                spec.block_size,
                spec.num_kv_heads,
                spec.head_size,
                spec.dtype_bytes,
                head_size_v=spec.head_size_v,
                sliding_window=getattr(spec, "sliding_window", None),
                attention_chunk_size=getattr(spec, "attention_chunk_size", None),
            )
        promoted[name] = spec
    kinds = sorted({spec.kind for spec in promoted.values()})
    if not all(isinstance(spec, FullAttentionSpec) for spec in promoted.values()):
        raise ConfigError(
            f"cannot disable the hybrid KV-cache manager: layers of kinds {kinds} cannot all be "
            "managed as full attention"
        )
    return promoted


def _scaled_block_size(spec: AttentionSpec, target_page_bytes: int) -> int | None:
    """Block size that makes `spec`'s page exactly `target_page_bytes`, or None if none does."""
    if spec.page_size_padded is not None or target_page_bytes % spec.page_size_bytes:
        return None
    return spec.block_size * (target_page_bytes // spec.page_size_bytes)


def _raise_attention_above_mamba(specs: dict[str, KVCacheSpec]) -> None:
    """Grow attention block sizes (in multiples of their own) until each page holds a Mamba state.

    Padding a small attention page up to a large Mamba state would waste most of every
    attention block; growing the block instead wastes at most one block size's worth in the
    Mamba page, which is then padded. Mamba specs in "align" mode take the largest attention
    block size, so a state block lines up with attention blocks for prefix caching ("none"
    mode specs get the model length in `size_kv_cache`).
    """
    mamba_page = max(s.page_size_bytes for s in specs.values() if isinstance(s, MambaSpec))
    block_sizes = []
    for name, spec in specs.items():
        if isinstance(spec, AttentionSpec):
            if spec.page_size_bytes < mamba_page and spec.page_size_padded is None:
                spec = replace(
                    spec, block_size=spec.block_size * cdiv(mamba_page, spec.page_size_bytes)
                )
                specs[name] = spec
            block_sizes.append(spec.block_size)
    if block_sizes:
        for name, spec in specs.items():
            if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "align":
                specs[name] = replace(spec, block_size=max(block_sizes))


def unify_page_sizes(layer_to_spec: Mapping[str, KVCacheSpec]) -> dict[str, KVCacheSpec]:
    """Give every layer the same page size, the largest one.

    A smaller attention page whose size divides the largest gets a proportionally larger block
    size; otherwise Mamba and non-MLA attention pages are padded (`page_size_padded`). With
    Mamba layers present, attention blocks are first grown to hold one Mamba state. Raises
    `ConfigError` for an MLA page that neither divides nor may be padded.
    """
    specs = dict(layer_to_spec)
    has_mamba = any(isinstance(s, MambaSpec) for s in specs.values())
    if has_mamba and any(isinstance(s, AttentionSpec) for s in specs.values()):
        _raise_attention_above_mamba(specs)
    max_page = max((s.page_size_bytes for s in specs.values()), default=0)
    for name, spec in specs.items():
        page = spec.page_size_bytes
        if page == max_page:
            continue
        block_size = _scaled_block_size(spec, max_page) if isinstance(spec, AttentionSpec) else None
        if block_size is not None:
            specs[name] = replace(spec, block_size=block_size)
        elif isinstance(spec, MambaSpec) or (
            isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec)
        ):
            specs[name] = replace(spec, page_size_padded=max_page)
        else:
            raise ConfigError(
                f"cannot unify page sizes: layer {name!r} ({spec.kind}) has a page of {page} "
                f"bytes that does not divide the largest page ({max_page} bytes) and cannot be "
                "padded; try disabling the hybrid KV-cache manager"
            )
    return specs


# --------------------------------------------------------------------------- grouping


def _uniform_type_representative(specs: list[KVCacheSpec]) -> KVCacheSpec | None:
    """The spec a single mixed-head-size group is managed by, or None if types differ.

    Uniform type: all attention of one class and one block size, with the same window or
    chunk; they may differ in KV heads, head size and dtype. Full-attention layers that keep
    different windows only for compute (hybrid manager off) count as uniform too.
    """
    first = specs[0]
    if not isinstance(first, AttentionSpec):
        return None
    for spec in specs:
        if type(spec) is not type(first) or spec.block_size != first.block_size:
            return None
        if not isinstance(spec, FullAttentionSpec) and (
            getattr(spec, "sliding_window", None) != getattr(first, "sliding_window", None)
            or getattr(spec, "attention_chunk_size", None)
            != getattr(first, "attention_chunk_size", None)
        ):
            return None
    if isinstance(first, FullAttentionSpec):
        # The filter drops nothing (the loop above returned on a type mismatch); it narrows.
        windows = {
            (s.sliding_window, s.attention_chunk_size)
            for s in specs
            if isinstance(s, FullAttentionSpec)
        }
        if len(windows) > 1:
            return replace(first, sliding_window=None, attention_chunk_size=None)
    return first


def _split_buckets(buckets: list[tuple[KVCacheSpec, list[str]]]) -> list[KVCacheGroupSpec]:
    """Equal-size groups: size = min layers per bucket (or the max if max < 1.5 × min).

    A bucket of L layers becomes `cdiv(L, size)` groups taking `layers[i::num_groups]`
    (round-robin, so pipeline stages stay balanced).
    """
    counts = [len(names) for _, names in buckets]
    min_count, max_count = min(counts), max(counts)
    # Fewer, fuller groups beat many groups when the buckets are nearly equal: the smaller
    # bucket's groups are padded by at most half.
    group_size = max_count if max_count < 1.5 * min_count else min_count
    groups = []
    for spec, names in buckets:
        num_groups = cdiv(len(names), group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroupSpec(tuple(names[i::num_groups]), spec))
    return groups


def get_kv_cache_layout(
    layer_to_spec: Mapping[str, KVCacheSpec], *, disable_hybrid: bool = False
) -> KVCacheLayout:
    """Group a model's layers (in model order) into KV-cache groups.

    One spec → one group. One attention type with mixed head sizes → one group (see
    `KVCacheLayout`). Otherwise pages are unified (`unify_page_sizes`) and layers with equal
    specs form buckets, in order of first appearance, split into equal-size groups.
    """
    for name, spec in layer_to_spec.items():
        if not isinstance(spec, KVCacheSpec):
            raise ConfigError(f"layer {name!r}: expected a KVCacheSpec, got {spec!r}")
    specs = promote_local_attention(layer_to_spec) if disable_hybrid else dict(layer_to_spec)
    if not specs:
        return KVCacheLayout((), MappingProxyType({}))
    distinct = list(dict.fromkeys(specs.values()))
    if len(distinct) == 1:
        group = KVCacheGroupSpec(tuple(specs), distinct[0])
        return KVCacheLayout((group,), MappingProxyType(specs))
    representative = _uniform_type_representative(distinct)
    if representative is not None:
        group = KVCacheGroupSpec(tuple(specs), representative)
        return KVCacheLayout((group,), MappingProxyType(specs))
    specs = unify_page_sizes(specs)
    spec_to_names: dict[KVCacheSpec, list[str]] = {}
    for name, spec in specs.items():
        spec_to_names.setdefault(spec, []).append(name)
    groups = _split_buckets(list(spec_to_names.items()))
    return KVCacheLayout(tuple(groups), MappingProxyType(specs))


# --------------------------------------------------------------------------- bytes → blocks


def _check_memory_args(available_memory_bytes: int, max_model_len: int) -> None:
    for name, value in (
        ("available_memory_bytes", available_memory_bytes),
        ("max_model_len", max_model_len),
    ):
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    if max_model_len <= 0:
        raise InvalidArgumentError(f"max_model_len must be positive, got {max_model_len}")


def _needed_bytes(
    layout: KVCacheLayout,
    max_model_len: int,
    max_in_flight_tokens: int | None,
    max_num_encoder_input_tokens: int,
) -> int:
    """Bytes for one worst-case request plus the null block (block 0 is never handed out)."""
    num_blocks = sum(
        layout.blocks_per_request(max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens)
    )
    return layout.bytes_per_block * (max(num_blocks, 1) + 1)


def estimate_max_model_len(
    layout: KVCacheLayout,
    available_memory_bytes: int,
    max_model_len_limit: int,
    *,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int = 0,
) -> int:
    """Longest `max_model_len` ≤ `max_model_len_limit` whose one request fits; 0 if none does.

    Binary search: the need never shrinks as the length grows.
    """
    _check_memory_args(available_memory_bytes, max_model_len_limit)

    def fits(num_tokens: int) -> bool:
        needed = _needed_bytes(
            layout, num_tokens, max_in_flight_tokens, max_num_encoder_input_tokens
        )
        return needed <= available_memory_bytes

    low, high = 0, max_model_len_limit  # fits(low) holds or low == 0
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def check_enough_memory(
    layout: KVCacheLayout,
    available_memory_bytes: int,
    max_model_len: int,
    *,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int = 0,
) -> None:
    """Raise `NotEnoughMemoryError` unless one request of `max_model_len` tokens fits.

    The null block is reserved: memory for exactly the request's blocks is rejected, one block
    more is accepted. The error carries `needed_bytes`, `available_bytes`, `max_model_len` and
    `max_model_len_that_fits` (0 when not even one token fits).
    """
    _check_memory_args(available_memory_bytes, max_model_len)
    if not layout.groups:
        return
    needed = _needed_bytes(
        layout, max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens
    )
    if needed <= available_memory_bytes:
        return
    if available_memory_bytes <= 0:
        raise _not_enough_memory(needed, available_memory_bytes, max_model_len, 0)
    longest = estimate_max_model_len(
        layout,
        available_memory_bytes,
        max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens,
    )
    raise _not_enough_memory(needed, available_memory_bytes, max_model_len, longest)


def _not_enough_memory(
    needed_bytes: int, available_bytes: int, max_model_len: int, longest: int
) -> NotEnoughMemoryError:
    if available_bytes <= 0:
        message = f"no memory available for the KV cache (available_memory_bytes={available_bytes})"
    else:
        fit = (
            f"the longest max_model_len that fits is {longest}"
            if longest > 0
            else "not even a 1-token request fits"
        )
        message = (
            f"not enough KV-cache memory: one request of max_model_len={max_model_len} needs "
            f"{needed_bytes} bytes ({format_gib(needed_bytes)} GiB, null block included), but "
            f"only {available_bytes} bytes ({format_gib(available_bytes)} GiB) are available; "
            f"{fit}"
        )
    return NotEnoughMemoryError(
        message,
        needed_bytes=needed_bytes,
        available_bytes=available_bytes,
        max_model_len=max_model_len,
        max_model_len_that_fits=longest,
    )


def get_num_blocks(layout: KVCacheLayout, available_memory_bytes: int) -> int:
    """Blocks the budget holds, the null block included (1 for an attention-free model)."""
    if not layout.groups:
        return 1
    return available_memory_bytes // layout.bytes_per_block


def get_kv_cache_config(layout: KVCacheLayout, num_blocks: int) -> KVCacheConfig:
    """The `KVCacheConfig` for `num_blocks` blocks, with its backing tensors.

    Tensor i is shared by layer i of every group (groups alias the same bytes: a block id
    belongs to one group at a time) and holds `num_blocks` pages, so the tensors add up to
    `bytes_per_block × num_blocks`.
    """
    groups = layout.groups
    tensors = []
    for i in range(max((len(g.layer_names) for g in groups), default=0)):
        shared_by = tuple(g.layer_names[i] for g in groups if i < len(g.layer_names))
        page = max(layout.layer_to_spec[name].page_size_bytes for name in shared_by)
        tensors.append(KVCacheTensor(size_bytes=page * num_blocks, shared_by=shared_by))
    return KVCacheConfig(num_blocks, groups, tuple(tensors))


def get_max_concurrency(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    *,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int = 0,
) -> float:
    """How many worst-case requests fit at once: `num_blocks / Σ_groups blocks per request`.

    Like the reference, `num_blocks` includes the null block (1536 blocks for a 1024-block
    request give 1.5).
    """
    num_blocks_per_request = sum(
        _blocks_per_request(
            kv_cache_config.kv_cache_groups,
            max_model_len,
            max_in_flight_tokens,
            max_num_encoder_input_tokens,
        )
    )
    if num_blocks_per_request == 0:
        return float("inf")
    return kv_cache_config.num_blocks / num_blocks_per_request


def _one_block_mamba_states(layout: KVCacheLayout, max_model_len: int) -> KVCacheLayout:
    """Give Mamba specs in "none" mode a block of `max_model_len` tokens, as the reference
    does: one block then holds a request's state whatever its length."""

    def resized(spec: KVCacheSpec) -> KVCacheSpec:
        if isinstance(spec, MambaSpec) and spec.mamba_cache_mode == "none":
            return replace(spec, block_size=max_model_len)
        return spec

    if not any(resized(group.kv_cache_spec) is not group.kv_cache_spec for group in layout.groups):
        return layout
    groups = tuple(
        replace(group, kv_cache_spec=resized(group.kv_cache_spec)) for group in layout.groups
    )
    layer_to_spec = {name: resized(spec) for name, spec in layout.layer_to_spec.items()}
    return KVCacheLayout(groups, MappingProxyType(layer_to_spec))


@dataclass(frozen=True)
class SizingResult:
    """Everything `size_kv_cache` worked out, for reports and for building a manager."""

    layout: KVCacheLayout
    kv_cache_config: KVCacheConfig
    available_memory_bytes: int
    max_model_len: int
    max_in_flight_tokens: int | None
    max_num_encoder_input_tokens: int
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: tuple[int, ...]
    max_concurrency: float

    @property
    def token_capacity(self) -> int:
        """Tokens the cache holds at full use: `int(max_concurrency × max_model_len)`."""
        return int(self.max_concurrency * self.max_model_len)

    @property
    def max_memory_usage_bytes(self) -> int:
        """Worst-case bytes of one request (null block not included)."""
        return self.bytes_per_block * sum(self.blocks_per_request)


def size_kv_cache(
    layer_to_spec: Mapping[str, KVCacheSpec],
    available_memory_bytes: int,
    max_model_len: int,
    *,
    max_in_flight_tokens: int | None = None,
    max_num_encoder_input_tokens: int = 0,
    disable_hybrid: bool = False,
) -> SizingResult:
    """Group the layers, check one request fits, and size the pool.

    Args:
        max_in_flight_tokens: tokens scheduled but not yet settled (≈ max_num_batched_tokens
            for a synchronous scheduler); None assumes `max_model_len` (no window saving).

    Returns:
        The layout, the `KVCacheConfig` and the derived numbers.

    Raises:
        NotEnoughMemoryError: one request of `max_model_len` tokens does not fit.
    """
    layout = _one_block_mamba_states(
        get_kv_cache_layout(layer_to_spec, disable_hybrid=disable_hybrid), max_model_len
    )
    check_enough_memory(
        layout,
        available_memory_bytes,
        max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens,
    )
    num_blocks = get_num_blocks(layout, available_memory_bytes)
    kv_cache_config = get_kv_cache_config(layout, num_blocks)
    return SizingResult(
        layout=layout,
        kv_cache_config=kv_cache_config,
        available_memory_bytes=available_memory_bytes,
        max_model_len=max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
        max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        bytes_per_block=layout.bytes_per_block,
        num_blocks=num_blocks,
        blocks_per_request=layout.blocks_per_request(
            max_model_len, max_in_flight_tokens, max_num_encoder_input_tokens
        ),
        max_concurrency=get_max_concurrency(
            kv_cache_config,
            max_model_len,
            max_in_flight_tokens=max_in_flight_tokens,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
        ),
    )
