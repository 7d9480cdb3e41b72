"""Engine adapter (extra `[gpu]`): the `triton` attention backend, launching `triton_kernels`.

Chooses tile sizes and the flash-decoding split count from host-known bounds only (the
metadata's `num_seqs`, `max_query_len`, `max_seq_len`), so a launch has no host sync and a
CUDA graph captured for a batch-size bucket replays the same grid. Knows nothing of models.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from pagedkv.engine import triton_kernels
from pagedkv.engine.attention_metadata import AttentionMetadata
from pagedkv.errors import ConfigError

LOG2_E = math.log2(math.e)
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows, columns and inner size
MAX_NUM_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256  # fewer keys a split and merging costs more than it hides


@dataclass(frozen=True)
class KernelTiles:
    """Tile shape of one `paged_attention_kernel` launch (see that kernel's docstring)."""

    block_q: int  # query tokens a program
    rows_per_token: int  # query heads of one KV head, padded to a power of two
    tile_n: int  # keys a loop iteration
    num_splits: int  # flash-decoding splits of the key range
    num_warps: int
    num_stages: int


def _pow2(value: int) -> int:
    return 1 << max(value - 1, 0).bit_length()


@functools.cache
def _num_programs_wanted(device: torch.device) -> int:
    """Enough programs to fill the GPU a few times over (4 a streaming multiprocessor)."""
    if device.type != "cuda":
        return 4
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


def choose_tiles(
    metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, device: torch.device
) -> KernelTiles:
    """Tiles for a step: decode batches (one query a sequence) split the keys when the batch
    alone cannot fill the GPU; prefill and mixed batches take several query tokens a program."""
    rows_per_token = _pow2(num_heads // num_kv_heads)
    if metadata.max_query_len == 1:
        rows_per_token = max(rows_per_token, MIN_DOT_ROWS)
        num_programs = metadata.num_seqs * num_kv_heads
        wanted = _pow2(math.ceil(_num_programs_wanted(device) / num_programs))
        useful = _pow2(max(metadata.max_seq_len // MIN_TOKENS_PER_SPLIT, 1))
        num_splits = max(1, min(wanted, useful, MAX_NUM_SPLITS))
        return KernelTiles(1, rows_per_token, 64, num_splits, num_warps=4, num_stages=2)
    block_m = max(64, rows_per_token)
    return KernelTiles(block_m // rows_per_token, rows_per_token, 32, 1, num_warps=4, num_stages=2)


def _check_device(tensor: torch.Tensor) -> None:
    if tensor.device.type == "cpu" and not triton_kernels.INTERPRETED:
        raise ConfigError(
            "the triton backend runs CPU tensors only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before starting Python, or put the model on the GPU"
        )


def write_kv_triton(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store `key`/`value` (`[num_tokens, num_kv_heads, head_dim]`) at their slots in one
    kernel; tokens whose slot is `PAD_SLOT_ID` are skipped."""
    _check_device(kv_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    tokens_per_program = 16 if triton_kernels.INTERPRETED else 4
    grid = (-(-num_tokens // tokens_per_program),)
    triton_kernels.write_kv_kernel[grid](
        key,
        value,
        kv_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=kv_cache.shape[2],
        TOKENS_PER_PROGRAM=tokens_per_program,
        KV_HEADS_PADDED=_pow2(num_kv_heads),
        HEAD_DIM_PADDED=_pow2(head_dim),
    )


def paged_attention_triton(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    tiles: KernelTiles | None = None,
) -> torch.Tensor:
    """Attention output `[num_tokens, num_heads, head_dim]` read straight from the pool.

    Same contract as `attention.paged_attention_reference`; `tiles` overrides `choose_tiles`
    (benchmarks sweep it).
    """
    _check_device(query)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    if query.stride(-1) != 1:
        query = query.contiguous()
    tiles = tiles or choose_tiles(metadata, num_heads, num_kv_heads, query.device)
    decode_only = metadata.max_query_len == 1
    head_dim_padded = max(_pow2(head_dim), MIN_DOT_ROWS)
    output = torch.empty_like(query)
    if tiles.num_splits > 1:
        partial_shape = (num_tokens, num_heads, tiles.num_splits)
        partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
        partial_acc = torch.empty(
            (*partial_shape, head_dim_padded), dtype=torch.float32, device=query.device
        )
    else:  # unused by the kernel; any tensor will do
        partial_max = partial_sum = partial_acc = output
    if decode_only:
        num_q_blocks = metadata.num_seqs
    else:  # each sequence owns query_start_loc[s] // block_q + s .. (see _find_sequence)
        num_q_blocks = num_tokens // tiles.block_q + metadata.num_seqs
    upcast = triton_kernels.INTERPRETED and query.dtype != torch.float32
    triton_kernels.paged_attention_kernel[(num_q_blocks, num_kv_heads, tiles.num_splits)](
        output,
        partial_acc,
        partial_max,
        partial_sum,
        query,
        kv_cache,
        metadata.block_ids,
        metadata.block_table_starts,
        metadata.query_start_loc,
        metadata.seq_lens,
        scale * LOG2_E,
        metadata.num_seqs,
        num_heads,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        SLIDING_WINDOW=sliding_window or 0,
        BLOCK_SIZE=metadata.block_size,
        GROUP_SIZE=num_heads // num_kv_heads,
        ROWS_PER_TOKEN=tiles.rows_per_token,
        BLOCK_Q=tiles.block_q,
        TILE_N=tiles.tile_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=head_dim_padded,
        NUM_SPLITS=tiles.num_splits,
        DECODE_ONLY=decode_only,
        UPCAST=upcast,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if tiles.num_splits > 1:
        triton_kernels.merge_splits_kernel[(num_tokens, num_heads)](
            output,
            partial_acc,
            partial_max,
            partial_sum,
            num_heads,
            output.stride(0),
            output.stride(1),
            NUM_SPLITS=tiles.num_splits,
            HEAD_DIM=head_dim,
            HEAD_DIM_PADDED=head_dim_padded,
        )
    return output
