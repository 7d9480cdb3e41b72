"""Engine adapter: causal attention over block tables, and the registry of attention backends.

Token q sees key position j iff `j <= q` and, with a sliding window W, `j > q - W` (W tokens,
itself included, as in transformers). Backends: `reference` (per-sequence gather, explicit
mask, float32 softmax: the yardstick), `sdpa` (gather every sequence's blocks into a padded
tensor, one SDPA call: the CPU path and the fallback), `triton` (kernels that read the pool
through the block tables, `triton_attention`). Knows nothing of models or of the manager.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedkv.engine.attention_metadata import AttentionMetadata
from pagedkv.engine.paged_kv import write_kv_torch
from pagedkv.errors import InvalidArgumentError, MissingDependencyError, install_hint
from pagedkv.specs import cdiv

ATTENTION_BACKENDS = ("sdpa", "reference", "triton")

AttendFn = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata, float, "int | None"], torch.Tensor
]
WriteKVFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class AttentionBackend:
    """How a layer stores its new K/V (`write_kv`) and attends over the pool (`attend`).

    `attend(query [num_tokens, num_heads, head_dim], kv_cache, metadata, scale, window)`
    returns `[num_tokens, num_heads, head_dim]`; `write_kv(kv_cache, key, value, slot_mapping)`.
    `graph_safe`: no host syncs and no shapes that vary with the step's contents (may be
    captured in a CUDA graph).
    """

    name: str
    attend: AttendFn
    write_kv: WriteKVFn
    graph_safe: bool = False


def paged_attention_reference(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Attention output `[num_tokens, num_heads, head_dim]`, one sequence at a time.

    Gathers each sequence's keys and values through its block table, repeats KV heads for
    grouped-query attention, and applies the causal (and window) mask explicitly; softmax in
    float32. Clear rather than fast (it reads the metadata back to the host).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    output = torch.empty_like(query)
    query_start_loc = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    tables = metadata.block_tables
    for seq in range(metadata.num_seqs):
        start, end = query_start_loc[seq], query_start_loc[seq + 1]
        seq_len = seq_lens[seq]
        num_blocks = cdiv(seq_len, metadata.block_size)
        pages = kv_cache[tables[seq, :num_blocks]]  # [blocks, 2, bs, kvh, d]
        keys = pages[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = pages[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys.float()) * scale
        query_pos = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        key_pos = torch.arange(seq_len, device=query.device)
        allowed = key_pos[None, :] <= query_pos[:, None]
        if sliding_window is not None:
            allowed &= key_pos[None, :] > query_pos[:, None] - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        output[start:end] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(query.dtype)
    return output


def paged_attention_sdpa(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Same result as `paged_attention_reference`, batched through one SDPA call.

    Queries are scattered into a `[num_seqs, max_query_len]` padded layout, keys and values
    gathered block-wise into `[num_seqs, max_num_blocks * block_size]`, and a boolean mask
    covers causality, the window and padding.
    """
    # Hot path: a fixed number of tensor ops per layer, no host syncs, no per-sequence loop.
    num_tokens, num_heads, head_dim = query.shape
    num_seqs, max_query_len = metadata.num_seqs, metadata.max_query_len
    num_kv_heads = kv_cache.shape[3]
    pages = kv_cache[metadata.block_tables]  # [seqs, blocks, 2, bs, kvh, d]
    keys = pages[:, :, 0].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    values = pages[:, :, 1].reshape(num_seqs, -1, num_kv_heads, head_dim).transpose(1, 2)
    if max_query_len == 1:
        padded = query.view(num_seqs, 1, num_heads, head_dim)  # decode: already one row a seq
    else:
        padded_query_index = metadata.padded_query_index
        padded = query.new_zeros(num_seqs * max_query_len, num_heads, head_dim)
        padded.index_copy_(0, padded_query_index, query)
        padded = padded.view(num_seqs, max_query_len, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        keys,
        values,
        attn_mask=metadata.mask(sliding_window),
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, num_heads, head_dim)
    if max_query_len == 1:
        return out
    return out.index_select(0, padded_query_index)


def get_attention_backend(name: str) -> AttentionBackend:
    """The attention backend called `name` (one of `ATTENTION_BACKENDS`).

    Raises `InvalidArgumentError` for an unknown name and `MissingDependencyError` when the
    `triton` backend is asked for without Triton installed.
    """
    if name == "sdpa":
        return AttentionBackend("sdpa", paged_attention_sdpa, write_kv_torch)
    if name == "reference":
        return AttentionBackend("reference", paged_attention_reference, write_kv_torch)
    if name == "triton":
        try:
            from pagedkv.engine import triton_attention
        except ImportError as exc:
            raise MissingDependencyError(
                f"the triton attention backend needs Triton: {install_hint('gpu')} ({exc})"
            ) from exc
        return AttentionBackend(
            "triton",
            triton_attention.paged_attention_triton,
            triton_attention.write_kv_triton,
            graph_safe=True,
        )
    raise InvalidArgumentError(f"attention backend {name!r}: choose one of {ATTENTION_BACKENDS}")
