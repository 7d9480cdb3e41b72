"""Engine adapter (extra `[gpu]`): Triton kernels that read and write K/V in the paged store.

Three kernels, all over the store layout `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
and block tables in CSR form (`block_ids[block_table_starts[s]:block_table_starts[s + 1]]` is
sequence s's table), so nothing is padded and nothing is copied:

- `write_kv_kernel`: stores each token's key and value at `slot_mapping[token]` (a slot < 0
  marks a padding token of a CUDA-graph batch and is skipped), a few tokens a program.
- `paged_attention_kernel`: flash attention over a ragged batch. A program owns `BLOCK_Q`
  query tokens of one sequence times the query heads of one KV head (grouped-query attention:
  the group's heads share every K/V tile load), walks the sequence's key tiles through the
  block table with an online softmax, and masks causality and the sliding window. With
  `NUM_SPLITS > 1` (flash decoding) the key range is cut into splits, each program writes an
  unnormalised partial result and `merge_splits_kernel` combines them.

Launched from `triton_attention`; knows nothing of models or scheduling. Without CUDA the
kernels run in Triton's interpreter (on CPU tensors), which is how CI tests them.
"""

from __future__ import annotations

import os
import sys

import torch

from pagedkv.engine import choose_triton_mode
from pagedkv.errors import ConfigError

choose_triton_mode()
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    raise ConfigError(
        "no GPU, and triton was imported before pagedkv could select its interpreter: set "
        "TRITON_INTERPRET=1 in the environment (or import pagedkv.engine before building models)"
        if "triton" in sys.modules
        else "no GPU and TRITON_INTERPRET is not 1: Triton kernels cannot run"
    )

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_mapping_ptr,
    num_tokens,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kv_block,
    stride_kv_value,
    stride_kv_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TOKENS_PER_PROGRAM: tl.constexpr,
    KV_HEADS_PADDED: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0) * TOKENS_PER_PROGRAM + tl.arange(0, TOKENS_PER_PROGRAM)
    slot = tl.load(slot_mapping_ptr + token, mask=token < num_tokens, other=-1).to(tl.int64)
    token = token.to(tl.int64)[:, None, None]
    head = tl.arange(0, KV_HEADS_PADDED)[None, :, None]
    dim = tl.arange(0, HEAD_DIM_PADDED)[None, None, :]
    # Padding tokens (slot < 0) and the rows past the batch are not written.
    mask = (slot >= 0)[:, None, None] & (head < NUM_KV_HEADS) & (dim < HEAD_DIM)
    key = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dim, mask)
    value = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + dim, mask)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    dst = kv_ptr + (block * stride_kv_block + offset * stride_kv_slot)[:, None, None]
    dst += head * stride_kv_head + dim
    tl.store(dst, key, mask)
    tl.store(dst + stride_kv_value, value, mask)


@triton.jit
def _find_sequence(query_start_loc_ptr, num_seqs, q_block, BLOCK_Q: tl.constexpr):
    """The sequence s owning global query block `q_block`: the last s with
    `query_start_loc[s] // BLOCK_Q + s <= q_block` (each sequence owns that many slots)."""
    low = 0
    high = num_seqs
    while high - low > 1:
        middle = (low + high) // 2
        first_block = tl.load(query_start_loc_ptr + middle) // BLOCK_Q + middle
        if first_block <= q_block:
            low = middle
        else:
            high = middle
    return low


@triton.jit
def paged_attention_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    kv_ptr,
    block_ids_ptr,
    block_table_starts_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    num_seqs,
    num_heads,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_kv_block,
    stride_kv_value,
    stride_kv_slot,
    stride_kv_head,
    SLIDING_WINDOW: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    ROWS_PER_TOKEN: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DECODE_ONLY: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * ROWS_PER_TOKEN
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE_ONLY:  # one query token a sequence: program 0 is sequence 0
        seq = tl.program_id(0)
        q_block = 0
    else:
        seq = _find_sequence(query_start_loc_ptr, num_seqs, tl.program_id(0), BLOCK_Q)
        q_block = tl.program_id(0) - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)
    query_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - query_start
    if q_block * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        num_computed = seq_len - query_len
        row = tl.arange(0, BLOCK_M)
        token = q_block * BLOCK_Q + row // ROWS_PER_TOKEN  # within the sequence's queries
        head = kv_head * GROUP_SIZE + row % ROWS_PER_TOKEN
        row_valid = (token < query_len) & (row % ROWS_PER_TOKEN < GROUP_SIZE)
        query_pos = num_computed + token
        dim = tl.arange(0, HEAD_DIM_PADDED)
        dim_valid = dim < HEAD_DIM
        flat_token = (query_start + token).to(tl.int64)
        q = tl.load(
            query_ptr
            + flat_token[:, None] * stride_query_token
            + head[:, None] * stride_query_head
            + dim[None, :],
            mask=row_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )
        if UPCAST:  # the interpreter multiplies bfloat16 as raw integers
            q = q.to(tl.float32)
        # Keys this block of queries can see: [key_low, key_high).
        first_query_pos = num_computed + q_block * BLOCK_Q
        key_high = tl.minimum(seq_len, first_query_pos + BLOCK_Q)
        key_low = 0
        if SLIDING_WINDOW > 0:
            key_low = tl.maximum(first_query_pos - SLIDING_WINDOW + 1, 0)
        tile_low = key_low // TILE_N
        # Integer arithmetic, not tl.cdiv: each jit-function call costs ~10 ms interpreted.
        num_tiles = (key_high + TILE_N - 1) // TILE_N - tile_low
        tiles_per_split = (num_tiles + NUM_SPLITS - 1) // NUM_SPLITS
        tile_begin = tile_low + split * tiles_per_split
        tile_end = tl.minimum(tile_begin + tiles_per_split, tile_low + num_tiles)
        table = block_ids_ptr + tl.load(block_table_starts_ptr + seq)
        kv_head_offset = kv_head.to(tl.int64) * stride_kv_head
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        running_sum = tl.full([BLOCK_M], 0.0, tl.float32)  # tl.full: a builtin, tl.zeros is jit
        acc = tl.full([BLOCK_M, HEAD_DIM_PADDED], 0.0, tl.float32)
        for tile in range(tile_begin, tile_end):
            key_pos = tile * TILE_N + tl.arange(0, TILE_N)
            key_valid = (key_pos >= key_low) & (key_pos < key_high)
            block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0)
            slot = block.to(tl.int64) * stride_kv_block + (key_pos % BLOCK_SIZE) * stride_kv_slot
            k = tl.load(  # [HEAD_DIM_PADDED, TILE_N]
                kv_ptr + kv_head_offset + slot[None, :] + dim[:, None],
                mask=key_valid[None, :] & dim_valid[:, None],
                other=0.0,
            )
            v = tl.load(  # [TILE_N, HEAD_DIM_PADDED]
                kv_ptr + stride_kv_value + kv_head_offset + slot[:, None] + dim[None, :],
                mask=key_valid[:, None] & dim_valid[None, :],
                other=0.0,
            )
            if UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2
            visible = key_valid[None, :] & (key_pos[None, :] <= query_pos[:, None])
            if SLIDING_WINDOW > 0:
                visible &= key_pos[None, :] > query_pos[:, None] - SLIDING_WINDOW
            scores = tl.where(visible, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=1))
            # A row with nothing visible yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            probs = tl.exp2(scores - shift[:, None])
            rescale = tl.exp2(running_max - shift)
            running_sum = running_sum * rescale + tl.sum(probs, axis=1)
            acc = acc * rescale[:, None] + tl.dot(
                probs.to(v.dtype), v, input_precision=DOT_PRECISION
            )
            running_max = new_max
        out_mask = row_valid[:, None] & dim_valid[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.where(running_sum > 0.0, running_sum, 1.0)[:, None]
            tl.store(
                out_ptr
                + flat_token[:, None] * stride_out_token
                + head[:, None] * stride_out_head
                + dim[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=out_mask,
            )
        else:
            partial = (flat_token * num_heads + head) * NUM_SPLITS + split
            tl.store(partial_max_ptr + partial, running_max, mask=row_valid)
            tl.store(partial_sum_ptr + partial, running_sum, mask=row_valid)
            tl.store(
                partial_acc_ptr + partial[:, None] * HEAD_DIM_PADDED + dim[None, :],
                acc,
                mask=out_mask,
            )


@triton.jit
def merge_splits_kernel(
    out_ptr,
    partial_acc_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    num_heads,
    stride_out_token,
    stride_out_head,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.arange(0, NUM_SPLITS)
    partial = (token * num_heads + head) * NUM_SPLITS + split
    split_max = tl.load(partial_max_ptr + partial)
    split_sum = tl.load(partial_sum_ptr + partial)
    total_max = tl.max(split_max, axis=0)
    # Empty splits carry max -inf and weigh 0.
    weight = tl.where(split_max == float("-inf"), 0.0, tl.exp2(split_max - total_max))
    dim = tl.arange(0, HEAD_DIM_PADDED)
    acc = tl.load(partial_acc_ptr + partial[:, None] * HEAD_DIM_PADDED + dim[None, :])
    total_sum = tl.sum(split_sum * weight, axis=0)
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(total_sum > 0.0, total_sum, 1.0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dim,
        out.to(out_ptr.dtype.element_ty),
        mask=dim < HEAD_DIM,
    )
