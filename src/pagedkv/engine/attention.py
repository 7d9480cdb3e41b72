"""Engine adapter: causal attention over block tables (a gather-based reference and SDPA).

A step's tokens are flattened: sequence b owns query rows `[query_start_loc[b],
query_start_loc[b + 1])`, at positions `num_computed_tokens[b] + i`; its keys and values for
positions `[0, seq_len)` live in the paged store at the blocks of its block table. Token q sees
key position j iff `j <= q` and, with a sliding window W, `j > q - W` (W tokens, itself included,
as in transformers). Knows nothing of models or of the KV-cache manager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedkv.engine.paged_kv import NULL_BLOCK_ID, slot_mapping
from pagedkv.errors import InvalidArgumentError
from pagedkv.specs import cdiv

ATTENTION_BACKENDS = ("sdpa", "reference")


@dataclass(eq=False)
class AttentionMetadata:
    """Where one step's tokens sit, for the layers of one KV-cache group (one block size).

    Python tuples serve the reference loop; tensors (on the model's device) serve the fast
    path. `block_tables` is `[num_seqs, max_num_blocks]`, padded with the null block, trimmed
    to the blocks the longest sequence reaches.
    """

    block_size: int
    query_start_loc: tuple[int, ...]
    num_computed_tokens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    max_query_len: int
    block_tables: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    # Row of each token in the padded `[num_seqs * max_query_len]` query layout.
    padded_query_index: torch.Tensor
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Boolean `[num_seqs, 1, max_query_len, max_num_blocks * block_size]` (True: attend)."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            mask = self._build_mask(sliding_window)
            self._masks[sliding_window] = mask
        return mask

    def _build_mask(self, sliding_window: int | None) -> torch.Tensor:
        device = self.block_tables.device
        num_kv_slots = self.block_tables.shape[1] * self.block_size
        computed = torch.tensor(self.num_computed_tokens, device=device)
        seq_lens = torch.tensor(self.seq_lens, device=device)
        rows = torch.arange(self.max_query_len, device=device)
        # Padding rows repeat the sequence's last query so no row is empty (SDPA would NaN).
        query_pos = torch.minimum(computed[:, None] + rows, (seq_lens - 1)[:, None])
        key_pos = torch.arange(num_kv_slots, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > (query_pos - sliding_window)[:, :, None]
        return mask[:, None]


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """Metadata for a step in which sequence b computes `num_new_tokens[b]` tokens.

    Raises `InvalidArgumentError` if a block table is too short for its sequence or a new
    token would land in the null block.
    """
    num_seqs = len(block_tables)
    if not num_seqs or len(num_computed_tokens) != num_seqs or len(num_new_tokens) != num_seqs:
        raise InvalidArgumentError(
            f"need one block table, computed count and new count per sequence, got "
            f"{num_seqs}, {len(num_computed_tokens)}, {len(num_new_tokens)}"
        )
    seq_lens = []
    query_start_loc = [0]
    num_blocks_needed = []
    for table, num_computed, num_new in zip(
        block_tables, num_computed_tokens, num_new_tokens, strict=True
    ):
        if num_new <= 0 or num_computed < 0:
            raise InvalidArgumentError(
                f"sequence with {num_computed} computed and {num_new} new tokens"
            )
        seq_len = num_computed + num_new
        needed = cdiv(seq_len, block_size)
        if len(table) < needed:
            raise InvalidArgumentError(
                f"block table of {len(table)} blocks cannot hold {seq_len} tokens "
                f"(block size {block_size})"
            )
        first_new_block = num_computed // block_size
        if NULL_BLOCK_ID in table[first_new_block:needed]:
            raise InvalidArgumentError(
                f"block table {list(table)} would write tokens {num_computed}..{seq_len - 1} "
                "into the null block"
            )
        seq_lens.append(seq_len)
        query_start_loc.append(query_start_loc[-1] + num_new)
        num_blocks_needed.append(needed)
    max_num_blocks = max(num_blocks_needed)
    padded_tables = [
        list(table[:needed]) + [NULL_BLOCK_ID] * (max_num_blocks - needed)
        for table, needed in zip(block_tables, num_blocks_needed, strict=True)
    ]
    max_query_len = max(num_new_tokens)
    tables = torch.tensor(padded_tables, dtype=torch.long, device=device)
    num_tokens = query_start_loc[-1]
    counts = torch.tensor(list(num_new_tokens), dtype=torch.long, device=device)
    token_to_seq = torch.repeat_interleave(torch.arange(num_seqs, device=device), counts)
    starts = torch.tensor(query_start_loc[:-1], dtype=torch.long, device=device)
    offsets = torch.arange(num_tokens, device=device) - starts[token_to_seq]
    computed = torch.tensor(list(num_computed_tokens), dtype=torch.long, device=device)
    positions = computed[token_to_seq] + offsets
    return AttentionMetadata(
        block_size=block_size,
        query_start_loc=tuple(query_start_loc),
        num_computed_tokens=tuple(num_computed_tokens),
        seq_lens=tuple(seq_lens),
        max_query_len=max_query_len,
        block_tables=tables,
        positions=positions,
        slot_mapping=slot_mapping(tables, token_to_seq, positions, block_size),
        padded_query_index=token_to_seq * max_query_len + offsets,
    )


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
    float32. Clear rather than fast: the yardstick for `paged_attention_sdpa`.
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    output = torch.empty_like(query)
    for seq in range(metadata.num_seqs):
        start, end = metadata.query_start_loc[seq], metadata.query_start_loc[seq + 1]
        seq_len = metadata.seq_lens[seq]
        num_blocks = cdiv(seq_len, metadata.block_size)
        pages = kv_cache[metadata.block_tables[seq, :num_blocks]]  # [blocks, 2, bs, kvh, d]
        keys = pages[:, 0].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = pages[:, 1].reshape(-1, num_kv_heads, head_dim)[:seq_len]
        keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=1)
        values = values.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[start:end].float()
        scores = torch.einsum("qhd,khd->hqk", q, keys.float()) * scale
        query_pos = torch.arange(metadata.num_computed_tokens[seq], seq_len, device=query.device)
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
        padded = query.new_zeros(num_seqs * max_query_len, num_heads, head_dim)
        padded.index_copy_(0, metadata.padded_query_index, query)
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
    return out.index_select(0, metadata.padded_query_index)


def get_attention_backend(name: str):
    """The attention function called `name` (one of `ATTENTION_BACKENDS`)."""
    if name == "sdpa":
        return paged_attention_sdpa
    if name == "reference":
        return paged_attention_reference
    raise InvalidArgumentError(f"attention backend {name!r}: choose one of {ATTENTION_BACKENDS}")
