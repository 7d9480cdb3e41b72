"""Leaf: KV-cache specs (what one layer stores per block), groups and the cache config.

Specs are small frozen dataclasses with `dtype_bytes: int` (no torch). Each spec knows its page
size and its worst-case memory per request; the manager class for a spec is chosen in
`pagedkv.managers`, never here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from math import prod
from typing import ClassVar

from pagedkv.errors import ConfigError


def cdiv(numerator: int, denominator: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(numerator // -denominator)


def _check_positive(spec: object, **values: int | None) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(
                f"{type(spec).__name__}: {name} must be a positive int, got {value!r}"
            )


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec: one block holds `block_size` tokens of one layer's KV (or one state)."""

    block_size: int
    # Whether decode context parallelism shards this layer's KV across ranks (attention: each
    # of `dcp_world_size` ranks holds every dcp-th token, so a block covers `block_size *
    # dcp_world_size` tokens of the sequence); a Mamba state is replicated, never sharded.
    dcp_sharded: bool = field(default=False, kw_only=True)

    kind: ClassVar[str] = "abstract"
    # Whether blocks of this spec may enter the prefix cache.
    prefix_cacheable: ClassVar[bool] = True
    # Whether block i holds tokens [i * block_size, (i + 1) * block_size) (not a scratch ring).
    covers_token_range: ClassVar[bool] = True

    def __post_init__(self) -> None:
        _check_positive(self, block_size=self.block_size)

    @property
    def prefix_replay_tokens(self) -> int:
        """Tokens of a hit the scheduler recomputes to rebuild this group (bounded replay)."""
        return 0

    @property
    def page_size_bytes(self) -> int:
        raise NotImplementedError

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        """Worst-case bytes one request of `max_model_len` tokens needs in this layer."""
        raise NotImplementedError

    def max_admission_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int | None:
        """Blocks a request can hold at once if it recycles blocks (None: no cap)."""
        return None


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Attention KV: `2 × block_size × num_kv_heads × head_size × dtype_bytes` bytes a page."""

    num_kv_heads: int
    head_size: int
    dtype_bytes: int
    head_size_v: int | None = field(default=None, kw_only=True)
    page_size_padded: int | None = field(default=None, kw_only=True)
    dcp_sharded: bool = field(default=True, kw_only=True)  # a draft model's may be replicated

    def __post_init__(self) -> None:
        _check_positive(
            self,
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            dtype_bytes=self.dtype_bytes,
        )
        if self.page_size_padded is not None:  # optional; required fields may not be None
            _check_positive(self, page_size_padded=self.page_size_padded)
        if self.head_size_v is not None and self.head_size_v < 0:
            raise ConfigError(f"{type(self).__name__}: head_size_v={self.head_size_v} < 0")
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ConfigError(
                f"{type(self).__name__}: page_size_padded={self.page_size_padded} is smaller "
                f"than the real page size {self.real_page_size_bytes}"
            )

    @property
    def real_page_size_bytes(self) -> int:
        head_size_v = self.head_size if self.head_size_v is None else self.head_size_v
        return (
            self.block_size * self.num_kv_heads * (self.head_size + head_size_v) * self.dtype_bytes
        )

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Full (global) causal attention: every token's KV is kept until the request ends.

    `sliding_window` / `attention_chunk_size` may be set when a local-attention layer is
    deliberately managed as full attention (the hybrid manager disabled): compute still uses
    the window, allocation does not.
    """

    sliding_window: int | None = field(default=None, kw_only=True)
    attention_chunk_size: int | None = field(default=None, kw_only=True)
    kind: ClassVar[str] = "full_attention"

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        return cdiv(max_model_len, self.block_size) * self.page_size_bytes


@dataclass(frozen=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding-window attention (R-SWA, vLLM 0.33): the prompt's tokens stay visible
    to every later token, generated tokens only within the last `rswa_window`. The blocks
    between the prompt's last block and the decode window (the gap) are freed as the window
    moves, so a request holds O(prompt + window) blocks; the prompt is prefix-cached as full
    attention. Sized as full attention (a request may end before any gap opens)."""

    rswa_window: int = field(default=0, kw_only=True)
    kind: ClassVar[str] = "full_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, rswa_window=self.rswa_window)


@dataclass(frozen=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention (DeepSeek-V2/V3): one latent vector a token, no separate V."""

    kind: ClassVar[str] = "mla_attention"

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * self.dtype_bytes


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Sliding-window attention: a token attends to the previous `sliding_window` tokens."""

    sliding_window: int
    # Tokens kept (not attended) below the window: multi-module MTP re-prefills the last
    # `num_prefill_lookahead - 1` tokens, so their blocks are freed that much later (vLLM 0.33).
    extra_retained_tokens: int = field(default=0, kw_only=True)
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, sliding_window=self.sliding_window)
        retained = self.extra_retained_tokens
        if not isinstance(retained, int) or isinstance(retained, bool) or retained < 0:
            raise ConfigError(
                f"{type(self).__name__}: extra_retained_tokens must be an int >= 0, "
                f"got {retained!r}"
            )

    def max_admission_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        # +1: the window may straddle a block boundary.
        needed_tokens = min(
            self.sliding_window - 1 + self.extra_retained_tokens + max_in_flight_tokens,
            max_model_len,
        )
        return cdiv(needed_tokens, self.block_size) + 1

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        return self.max_admission_blocks(max_model_len, in_flight) * self.page_size_bytes


@dataclass(frozen=True)
class ReplayedSlidingWindowSpec(SlidingWindowSpec):
    """Sliding-window attention rebuilt by bounded prefix replay (vLLM's `bounded_replay`,
    DeepSeek-V4.1's compressed-attention windows): its blocks never enter the prefix cache, so
    a hit is decided by the other groups alone and this group gets none; the scheduler
    recomputes the hit's last `prefix_replay_tokens` (the window) to rebuild its KV.
    Allocation is a sliding window's: positions outside the window are the null block."""

    prefix_cacheable: ClassVar[bool] = False

    @property
    def prefix_replay_tokens(self) -> int:
        return self.sliding_window


@dataclass(frozen=True)
class CircularBufferSpec(AttentionSpec):
    """A ring of `block_size` rows, one block per request for its whole life (vLLM 0.33's
    `CircularBufferSpec`: the raw keys of the token group a compressor is still compressing,
    DeepSeek-V4's CSA and GLM-5's indexer tail). Scratch: never prefix-cached, no token range
    (positions are never skipped, its block size is no part of the scheduler's block lattice)."""

    kind: ClassVar[str] = "circular_buffer"
    prefix_cacheable: ClassVar[bool] = False
    covers_token_range: ClassVar[bool] = False

    def max_admission_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        return 1

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        return self.page_size_bytes


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    """Chunked local attention (Llama 4): a token attends within its own chunk."""

    attention_chunk_size: int
    kind: ClassVar[str] = "chunked_local_attention"

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive(self, attention_chunk_size=self.attention_chunk_size)

    def max_admission_blocks(self, max_model_len: int, max_in_flight_tokens: int) -> int:
        needed_tokens = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(needed_tokens, self.block_size)

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        in_flight = max_model_len if max_in_flight_tokens is None else max_in_flight_tokens
        return self.max_admission_blocks(max_model_len, in_flight) * self.page_size_bytes


@dataclass(frozen=True)
class CrossAttentionSpec(AttentionSpec):
    """Encoder-decoder cross-attention: sized by the encoder input, never prefix-cached."""

    kind: ClassVar[str] = "cross_attention"
    prefix_cacheable: ClassVar[bool] = False

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        return cdiv(max_num_encoder_input_tokens, self.block_size) * self.page_size_bytes


MAMBA_CACHE_MODES = ("none", "align")


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """Mamba / SSM state: one fixed-size state a request, independent of its length.

    `shapes` lists the state tensors (conv state, SSM state); a bare int is a one-dimensional
    shape (`(1, 1)` is two one-element states, as vLLM's tests write them). `dtype_bytes` is one
    size for all, or one per shape. `mamba_cache_mode` (the reference's): "none" keeps only the
    current state (no prefix caching; the reference then makes `block_size` the model length,
    so one block holds it), "align" also keeps the states at block boundaries for prefix hits.
    """

    shapes: tuple[tuple[int, ...], ...]
    dtype_bytes: int | tuple[int, ...]
    page_size_padded: int | None = field(default=None, kw_only=True)
    # "align": states at block boundaries are prefix-cached; "none": no prefix caching.
    mamba_cache_mode: str = field(default="none", kw_only=True)
    # Extra state blocks a request holds for speculative decoding (MTP/EAGLE drafts).
    num_speculative_blocks: int = field(default=0, kw_only=True)
    # "align": extra state blocks a prefill chunk may reserve to keep the state at the prompt's
    # reusable boundary (vLLM 0.33's prefill checkpoint; Mamba-2 layers ask for one), and the
    # token grid the worker can export that state on (None: no checkpoint is ever taken).
    num_prefill_checkpoint_blocks: int = field(default=0, kw_only=True)
    prefill_checkpoint_alignment: int | None = field(default=None, kw_only=True)
    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.shapes, (tuple, list)):
            object.__setattr__(
                self,
                "shapes",
                tuple(
                    (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else shape
                    for shape in self.shapes
                ),
            )
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ConfigError(
                f"MambaSpec: mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, got "
                f"{self.mamba_cache_mode!r}"
            )
        if (
            not isinstance(self.num_speculative_blocks, int)
            or isinstance(self.num_speculative_blocks, bool)
            or self.num_speculative_blocks < 0
        ):
            raise ConfigError(
                "MambaSpec: num_speculative_blocks must be an int >= 0, got "
                f"{self.num_speculative_blocks!r}"
            )
        checkpoint_blocks = self.num_prefill_checkpoint_blocks
        if (
            not isinstance(checkpoint_blocks, int)
            or isinstance(checkpoint_blocks, bool)
            or checkpoint_blocks < 0
        ):
            raise ConfigError(
                "MambaSpec: num_prefill_checkpoint_blocks must be an int >= 0, got "
                f"{checkpoint_blocks!r}"
            )
        if self.prefill_checkpoint_alignment is not None:
            _check_positive(self, prefill_checkpoint_alignment=self.prefill_checkpoint_alignment)
        if (
            not isinstance(self.shapes, tuple)
            or not self.shapes
            or any(
                not isinstance(shape, (tuple, list))
                or not shape
                or any(not isinstance(d, int) or isinstance(d, bool) or d <= 0 for d in shape)
                for shape in self.shapes
            )
        ):
            raise ConfigError(
                f"MambaSpec: shapes must be non-empty positive dims, got {self.shapes!r}"
            )
        sizes = self.dtype_bytes if isinstance(self.dtype_bytes, tuple) else (self.dtype_bytes,)
        if isinstance(self.dtype_bytes, tuple) and len(sizes) != len(self.shapes):
            raise ConfigError(
                f"MambaSpec: {len(sizes)} dtype sizes for {len(self.shapes)} state shapes"
            )
        _check_positive(self, **{f"dtype_bytes[{i}]": s for i, s in enumerate(sizes)})
        if self.page_size_padded is not None and self.page_size_padded < self.real_page_size_bytes:
            raise ConfigError(
                f"MambaSpec: page_size_padded={self.page_size_padded} < real page size "
                f"{self.real_page_size_bytes}"
            )

    @property
    def real_page_size_bytes(self) -> int:
        sizes = (
            self.dtype_bytes
            if isinstance(self.dtype_bytes, tuple)
            else (self.dtype_bytes,) * len(self.shapes)
        )
        return sum(prod(shape) * size for shape, size in zip(self.shapes, sizes, strict=True))

    @property
    def page_size_bytes(self) -> int:
        if self.page_size_padded is not None:
            return self.page_size_padded
        return self.real_page_size_bytes

    def max_state_blocks_per_request(self) -> int:
        """State blocks a request holds at most, whatever its length (the reference's count).

        "none": its one state block; "align": the last state and the one being written, plus
        the prefill checkpoint blocks. Either way plus the speculative blocks.
        """
        if self.mamba_cache_mode == "align":
            return 2 + self.num_speculative_blocks + self.num_prefill_checkpoint_blocks
        return 1 + self.num_speculative_blocks

    def max_memory_usage_bytes(
        self,
        max_model_len: int,
        max_in_flight_tokens: int | None = None,
        max_num_encoder_input_tokens: int = 0,
    ) -> int:
        return self.max_state_blocks_per_request() * self.page_size_bytes


@dataclass(frozen=True)
class SpecDecodeConfig:
    """What speculative decoding asks of the prefix cache (the reference's names).

    `use_eagle`: an EAGLE/MTP drafter recomputes the last matched block, so hits of draft
    groups (`KVCacheGroupSpec.is_eagle_group`, or every group if none is flagged) drop it.
    `num_prefill_lookahead`: prefill tokens past the computed range the drafter reads; the last
    `num_prefill_lookahead - 1` computed tokens may be re-prefilled, so they are not cached yet.
    `num_hash_lookahead_tokens`: tokens after each block that its hash covers (the request's
    hasher emits a block's hash only once they exist); events report them.
    """

    use_eagle: bool = False
    num_prefill_lookahead: int = 0
    num_hash_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("num_prefill_lookahead", "num_hash_lookahead_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be an int >= 0, got {value!r}")

    @property
    def num_reprefillable_tokens(self) -> int:
        """Trailing computed tokens that multi-module MTP may prefill again."""
        return max(0, self.num_prefill_lookahead - 1)


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one block table (same spec); the group's position is its id."""

    layer_names: tuple[str, ...]
    kv_cache_spec: KVCacheSpec
    # Draft-model (EAGLE/MTP) layers: this group's prefix hits drop the last block.
    is_eagle_group: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.layer_names, str):
            raise ConfigError(f"layer_names must be a sequence of names, got {self.layer_names!r}")
        object.__setattr__(self, "layer_names", tuple(self.layer_names))
        if not isinstance(self.kv_cache_spec, KVCacheSpec):
            raise ConfigError(f"kv_cache_spec must be a KVCacheSpec, got {self.kv_cache_spec!r}")


@dataclass(frozen=True)
class KVCacheTensor:
    """One backing buffer of `size_bytes`, shared by the named layers (one per group)."""

    size_bytes: int
    shared_by: tuple[str, ...]


@dataclass(frozen=True)
class KVCacheConfig:
    """How many blocks the pool has and which groups draw from it.

    No groups describes an attention-free model (sizing returns it, with one block); a
    `KVCacheManager` refuses such a config, having nothing to manage.
    """

    num_blocks: int
    kv_cache_groups: tuple[KVCacheGroupSpec, ...]
    kv_cache_tensors: tuple[KVCacheTensor, ...] = ()
    # Sparse retention of sliding-window states (reference name): None caches every block;
    # 0 keeps only the tails a later hit can resume at; N > 0 also one tail per N tokens.
    prefix_cache_retention_interval: int | None = None
    # Record newly allocated attention blocks for the worker to zero (`take_new_block_ids`).
    needs_kv_cache_zeroing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_groups", tuple(self.kv_cache_groups))
        object.__setattr__(self, "kv_cache_tensors", tuple(self.kv_cache_tensors))
        if not isinstance(self.num_blocks, int) or isinstance(self.num_blocks, bool):
            raise ConfigError(f"num_blocks must be an int, got {self.num_blocks!r}")
        interval = self.prefix_cache_retention_interval
        if interval is not None and (
            not isinstance(interval, int) or isinstance(interval, bool) or interval < 0
        ):
            raise ConfigError(
                f"prefix_cache_retention_interval must be None or an int >= 0, got {interval!r}"
            )
        minimum = 2 if self.kv_cache_groups else 1
        if self.num_blocks < minimum:
            raise ConfigError(
                f"num_blocks={self.num_blocks}: need at least {minimum} (block 0 is the null "
                "block, so a usable pool has two or more)"
            )


def shard_across_context_parallel_ranks(
    config: KVCacheConfig, dcp_world_size: int
) -> KVCacheConfig:
    """The config as the block manager sees it under decode context parallelism (vLLM 0.33's
    accounting): a sharded group's block covers `block_size * dcp_world_size` tokens of the
    sequence (each rank holds `block_size` of them, so the bytes a block takes per rank do not
    change); replicated groups (Mamba, replicated drafts) keep their block size."""
    if dcp_world_size == 1:
        return config
    groups = tuple(
        replace(group, kv_cache_spec=_sharded(group.kv_cache_spec, dcp_world_size))
        if group.kv_cache_spec.dcp_sharded
        else group
        for group in config.kv_cache_groups
    )
    return replace(config, kv_cache_groups=groups)


def _sharded(spec: KVCacheSpec, dcp_world_size: int) -> KVCacheSpec:
    # A padded page grows with the block (the manager counts blocks, never bytes).
    if isinstance(spec, AttentionSpec) and spec.page_size_padded is not None:
        return replace(
            spec,
            block_size=spec.block_size * dcp_world_size,
            page_size_padded=spec.page_size_padded * dcp_world_size,
        )
    return replace(spec, block_size=spec.block_size * dcp_world_size)
