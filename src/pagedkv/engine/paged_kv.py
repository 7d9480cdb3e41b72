"""Engine adapter: the paged KV tensors, sized from a `KVCacheConfig`, and the slot mapping.

One tensor per attention layer, `[num_blocks, 2, block_size, num_kv_heads, head_dim]` (index 0
of dim 1 holds keys, 1 values). Block ids are the ids pagedkv's `BlockPool` hands out; block 0
is the null block and is never written. Knows nothing of models or scheduling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.errors import ConfigError, InvalidArgumentError, InvariantViolation
from pagedkv.specs import AttentionSpec, KVCacheConfig, cdiv

NULL_BLOCK_ID = 0
# Slot of a padding token in a CUDA-graph batch: written nowhere. A device tensor has no None,
# so the padding is marked in band here and nowhere else (the kernels skip slots < 0).
PAD_SLOT_ID = -1


def kv_page_shape(spec: AttentionSpec) -> tuple[int, int, int, int]:
    """Shape of one block of one layer: `(2, block_size, num_kv_heads, head_dim)`."""
    return (2, spec.block_size, spec.num_kv_heads, spec.head_size)


def _check_spec(layer_name: str, spec: object, dtype: torch.dtype) -> AttentionSpec:
    if not isinstance(spec, AttentionSpec) or spec.kind not in ("full_attention", "sliding_window"):
        raise ConfigError(
            f"layer {layer_name!r}: the torch engine stores full or sliding-window attention KV, "
            f"got {type(spec).__name__}"
        )
    if spec.head_size_v not in (None, spec.head_size):
        raise ConfigError(f"layer {layer_name!r}: head_size_v={spec.head_size_v} is not supported")
    element_bytes = torch.empty((), dtype=dtype).element_size()
    if spec.dtype_bytes != element_bytes:
        raise ConfigError(
            f"layer {layer_name!r}: spec dtype_bytes={spec.dtype_bytes} but the store dtype "
            f"{dtype} has {element_bytes} bytes an element"
        )
    if spec.page_size_bytes != spec.real_page_size_bytes:
        raise ConfigError(
            f"layer {layer_name!r}: padded pages ({spec.page_size_bytes} > "
            f"{spec.real_page_size_bytes} bytes) are not supported by the torch engine"
        )
    return spec


class PagedKVStore:
    """The KV tensors of every attention layer named in a `KVCacheConfig`.

    Invariants: every layer's tensor has `num_blocks` blocks of its spec's page size; block 0
    (the null block) is all zeros, because `write` refuses slots inside it. When the config
    lists `kv_cache_tensors`, the layers named in one tensor's `shared_by` alias the same bytes
    (a block id belongs to one KV-cache group at a time, so they never collide); otherwise each
    layer gets its own tensor.
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = kv_cache_config.num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.layer_to_group: dict[str, int] = {}
        self.layer_to_spec: dict[str, AttentionSpec] = {}
        for group_id, group in enumerate(kv_cache_config.kv_cache_groups):
            for layer_name in group.layer_names:
                if layer_name in self.layer_to_group:
                    raise ConfigError(f"layer {layer_name!r} appears in two KV-cache groups")
                self.layer_to_group[layer_name] = group_id
                self.layer_to_spec[layer_name] = _check_spec(layer_name, group.kv_cache_spec, dtype)
        self.kv_caches: dict[str, torch.Tensor] = {}
        if kv_cache_config.kv_cache_tensors:
            self._allocate_shared(kv_cache_config)
        else:
            for layer_name, spec in self.layer_to_spec.items():
                self.kv_caches[layer_name] = torch.zeros(
                    (self.num_blocks, *kv_page_shape(spec)), dtype=dtype, device=self.device
                )

    def _allocate_shared(self, kv_cache_config: KVCacheConfig) -> None:
        for tensor in kv_cache_config.kv_cache_tensors:
            buffer = torch.zeros(tensor.size_bytes, dtype=torch.uint8, device=self.device)
            for layer_name in tensor.shared_by:
                spec = self.layer_to_spec.get(layer_name)
                if spec is None:
                    raise ConfigError(f"kv_cache_tensors names unknown layer {layer_name!r}")
                if tensor.size_bytes != self.num_blocks * spec.page_size_bytes:
                    raise ConfigError(
                        f"layer {layer_name!r}: tensor of {tensor.size_bytes} bytes does not hold "
                        f"{self.num_blocks} pages of {spec.page_size_bytes} bytes"
                    )
                self.kv_caches[layer_name] = buffer.view(self.dtype).view(
                    self.num_blocks, *kv_page_shape(spec)
                )
        missing = sorted(set(self.layer_to_spec) - set(self.kv_caches))
        if missing:
            raise ConfigError(f"kv_cache_tensors leave layers without memory: {missing}")

    @property
    def memory_bytes(self) -> int:
        """Bytes held by the distinct backing buffers."""
        seen: dict[int, int] = {}
        for kv in self.kv_caches.values():
            storage = kv.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    def write(
        self, layer_name: str, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store `key`/`value` (`[num_tokens, num_kv_heads, head_dim]`) at their slots."""
        write_kv_torch(self.kv_caches[layer_name], key, value, slot_mapping)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Run a step's block copies (`(src_block_id, dst_block_id)` pairs, the scheduler's
        `kv_cache_block_copies`) in every layer, in order: a hit that ends inside a block goes
        on in a private copy of it. A block belongs to one group at a time, so copying it in
        other groups' layers (or twice through an aliased buffer) is harmless."""
        if not copies:
            return
        for src, dst in copies:
            for block_id in (src, dst):
                if not 0 < block_id < self.num_blocks:
                    raise InvalidArgumentError(
                        f"block copy {src} -> {dst}: block {block_id} is not in "
                        f"[1, {self.num_blocks})"
                    )
        for kv in self.kv_caches.values():
            for src, dst in copies:
                kv[dst].copy_(kv[src])

    def read_tokens(
        self, layer_name: str, block_ids: Sequence[int], num_tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the first `num_tokens` positions of a block table (for tests)."""
        kv = self.kv_caches[layer_name]
        block_size = kv.shape[2]
        if len(block_ids) < cdiv(num_tokens, block_size):
            raise InvalidArgumentError(
                f"{len(block_ids)} blocks cannot hold {num_tokens} tokens (block size {block_size})"
            )
        index = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
        pages = kv.index_select(0, index)  # [num_blocks, 2, block_size, heads, dim]
        keys = pages[:, 0].reshape(-1, *kv.shape[3:])[:num_tokens]
        values = pages[:, 1].reshape(-1, *kv.shape[3:])[:num_tokens]
        return keys, values

    def check_invariants(self) -> None:
        """Raise `InvariantViolation` if a null block was written."""
        for layer_name, kv in self.kv_caches.items():
            if bool(kv[NULL_BLOCK_ID].any()):
                raise InvariantViolation(f"layer {layer_name!r}: the null block was written")


def write_kv_torch(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` (`[num_tokens, num_kv_heads, head_dim]`) at their slots.

    `slot_mapping[i] = block_id * block_size + offset` for token i; the caller (the metadata
    builder) has checked that no slot lies in the null block. Padding slots are not allowed
    here (only the Triton kernel skips them).
    """
    # Hot path: one scatter per tensor, no host sync.
    block_size = kv_cache.shape[2]
    block_ids = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping - block_ids * block_size
    kv_cache[:, 0].index_put_((block_ids, offsets), key)
    kv_cache[:, 1].index_put_((block_ids, offsets), value)
