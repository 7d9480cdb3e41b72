"""Engine adapter: where one step's tokens sit in the paged store (the attention metadata).

A step's tokens are flattened: sequence s owns query rows `[query_start_loc[s],
query_start_loc[s + 1])`, at positions `num_computed + i`; its keys and values for positions
`[0, seq_len)` live at the blocks of its block table, kept in CSR form (`block_ids[
block_table_starts[s]:block_table_starts[s + 1]]`), trimmed to the blocks it reaches. The host
packs a step into one int32 tensor (`pack_step`), which goes to the device in one copy; every
derived tensor (positions, slot mapping) is computed there (`derive_metadata`), without a
host sync, so a CUDA graph can replay the derivation too. Knows nothing of models.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.engine.paged_kv import NULL_BLOCK_ID, PAD_SLOT_ID
from pagedkv.errors import InvalidArgumentError
from pagedkv.specs import cdiv


@dataclass(frozen=True)
class PackedStep:
    """One step of one KV-cache group, packed on the host (see `pack_step`).

    `host` is int32 `[query_start_loc (S+1) | seq_lens (S) | block_table_starts (S+1) |
    block_ids (B)]` for S sequences with B table entries in all.
    """

    host: torch.Tensor
    block_size: int
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    max_num_blocks: int


@dataclass(eq=False)
class AttentionMetadata:
    """Device tensors describing one step for the layers of one KV-cache group.

    Invariants: `query_start_loc` (int32, `[num_seqs + 1]`) starts at 0 and ends at
    `num_tokens`; `seq_lens` (int32) count each sequence's tokens after the step; every new
    token's slot lies outside the null block, except padding tokens of a CUDA-graph batch,
    whose table is the null block alone and whose slot is `PAD_SLOT_ID` (never written).
    The host ints are bounds the kernels are sized by (a CUDA graph uses its bucket's).
    """

    block_size: int
    num_seqs: int
    num_tokens: int
    max_query_len: int
    max_seq_len: int
    max_num_blocks: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table_starts: torch.Tensor
    block_ids: torch.Tensor
    token_to_seq: torch.Tensor  # int64 [num_tokens]
    positions: torch.Tensor  # int64 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    _block_tables: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @property
    def num_computed_tokens(self) -> torch.Tensor:
        """int32 `[num_seqs]`: tokens of each sequence computed before this step."""
        return self.seq_lens - (self.query_start_loc[1:] - self.query_start_loc[:-1])

    @property
    def block_tables(self) -> torch.Tensor:
        """int64 `[num_seqs, max_num_blocks]`, padded with the null block (for gathers)."""
        if self._block_tables is None:
            device = self.block_ids.device
            starts = self.block_table_starts.long()
            lengths = starts[1:] - starts[:-1]
            column = torch.arange(self.max_num_blocks, device=device)
            index = (starts[:-1, None] + column).clamp(max=max(self.block_ids.numel() - 1, 0))
            tables = self.block_ids.long()[index]
            self._block_tables = torch.where(column < lengths[:, None], tables, NULL_BLOCK_ID)
        return self._block_tables

    @property
    def padded_query_index(self) -> torch.Tensor:
        """Row of each token in the padded `[num_seqs * max_query_len]` query layout."""
        offsets = torch.arange(self.num_tokens, device=self.positions.device)
        offsets = offsets - self.query_start_loc.long()[self.token_to_seq]
        return self.token_to_seq * self.max_query_len + offsets

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """Boolean `[num_seqs, 1, max_query_len, max_num_blocks * block_size]` (True: attend)."""
        mask = self._masks.get(sliding_window)
        if mask is None:
            mask = self._build_mask(sliding_window)
            self._masks[sliding_window] = mask
        return mask

    def _build_mask(self, sliding_window: int | None) -> torch.Tensor:
        device = self.positions.device
        num_kv_slots = self.max_num_blocks * self.block_size
        seq_lens = self.seq_lens.long()
        rows = torch.arange(self.max_query_len, device=device)
        # Padding rows repeat the sequence's last query so no row is empty (SDPA would NaN).
        query_pos = torch.minimum(
            self.num_computed_tokens.long()[:, None] + rows, (seq_lens - 1)[:, None]
        )
        key_pos = torch.arange(num_kv_slots, device=device)
        mask = key_pos[None, None, :] <= query_pos[:, :, None]
        if sliding_window is not None:
            mask &= key_pos[None, None, :] > (query_pos - sliding_window)[:, :, None]
        return mask[:, None]


def pack_step(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
) -> PackedStep:
    """Check and pack a step in which sequence s computes `num_new_tokens[s]` tokens.

    Raises `InvalidArgumentError` if a block table is too short for its sequence or a new
    token would land in the null block.
    """
    num_seqs = len(block_tables)
    if not num_seqs or len(num_computed_tokens) != num_seqs or len(num_new_tokens) != num_seqs:
        raise InvalidArgumentError(
            f"need one block table, computed count and new count per sequence, got "
            f"{num_seqs}, {len(num_computed_tokens)}, {len(num_new_tokens)}"
        )
    query_start_loc = array("i", [0])
    seq_lens = array("i")
    starts = array("i", [0])
    block_ids = array("i")
    max_num_blocks = 0
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
        if NULL_BLOCK_ID in table[num_computed // block_size : needed]:
            raise InvalidArgumentError(
                f"block table {list(table)} would write tokens {num_computed}..{seq_len - 1} "
                "into the null block"
            )
        query_start_loc.append(query_start_loc[-1] + num_new)
        seq_lens.append(seq_len)
        # Hot path: one C-level copy a sequence (a slice only when the table runs longer);
        # array.fromlist is about twice as fast as extend for a list.
        part = table if len(table) == needed else table[:needed]
        if type(part) is list:
            block_ids.fromlist(part)
        else:
            block_ids.extend(part)
        starts.append(len(block_ids))
        max_num_blocks = max(max_num_blocks, needed)
    host = torch.frombuffer(query_start_loc + seq_lens + starts + block_ids, dtype=torch.int32)
    return PackedStep(
        host=host,
        block_size=block_size,
        num_seqs=num_seqs,
        num_tokens=query_start_loc[-1],
        max_query_len=max(num_new_tokens),
        max_seq_len=max(seq_lens),
        max_num_blocks=max_num_blocks,
    )


def derive_metadata(
    packed: torch.Tensor,
    *,
    block_size: int,
    num_seqs: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
    max_num_blocks: int,
) -> AttentionMetadata:
    """The metadata of a packed step already on its device: views plus derived tensors.

    Only device ops with host-known sizes (no sync), so a CUDA graph can capture them.
    """
    device = packed.device
    query_start_loc = packed[: num_seqs + 1]
    seq_lens = packed[num_seqs + 1 : 2 * num_seqs + 1]
    block_table_starts = packed[2 * num_seqs + 1 : 3 * num_seqs + 2]
    block_ids = packed[3 * num_seqs + 2 :]
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    token_to_seq = torch.repeat_interleave(
        torch.arange(num_seqs, device=device), query_lens, output_size=num_tokens
    )
    offsets = torch.arange(num_tokens, device=device) - query_start_loc.long()[token_to_seq]
    positions = (seq_lens.long() - query_lens)[token_to_seq] + offsets
    block_index = torch.div(positions, block_size, rounding_mode="floor")
    block = block_ids.long()[block_table_starts.long()[token_to_seq] + block_index]
    slots = block * block_size + (positions - block_index * block_size)
    # Only padding tokens map to the null block (`pack_step` refuses it for real ones).
    slot_mapping = torch.where(block == NULL_BLOCK_ID, PAD_SLOT_ID, slots)
    return AttentionMetadata(
        block_size=block_size,
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        max_num_blocks=max_num_blocks,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table_starts=block_table_starts,
        block_ids=block_ids,
        token_to_seq=token_to_seq,
        positions=positions,
        slot_mapping=slot_mapping,
    )


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy a host tensor to `device` without blocking the host (pinned staging on CUDA)."""
    if device.type != "cuda":
        return host.to(device)
    # Hot path: torch's caching host allocator recycles the pinned buffer once the copy is done.
    return host.pin_memory().to(device, non_blocking=True)


def build_attention_metadata(
    block_tables: Sequence[Sequence[int]],
    num_computed_tokens: Sequence[int],
    num_new_tokens: Sequence[int],
    block_size: int,
    device: torch.device | str = "cpu",
) -> AttentionMetadata:
    """`pack_step`, one copy to `device`, `derive_metadata`."""
    step = pack_step(block_tables, num_computed_tokens, num_new_tokens, block_size)
    return derive_metadata(
        to_device(step.host, torch.device(device)),
        block_size=block_size,
        num_seqs=step.num_seqs,
        num_tokens=step.num_tokens,
        max_query_len=step.max_query_len,
        max_seq_len=step.max_seq_len,
        max_num_blocks=step.max_num_blocks,
    )
