"""Mamba in cache mode "align": states at block (or, with sub-block hits, hash-block) boundaries
are prefix-cached; a request holds at most two state blocks (the last one and the one being
written) plus its speculative blocks, and a prefill checkpoint's block when one is reserved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.managers.base import EMPTY_BLOCK_LIST
from pagedkv.managers.mamba import (
    MambaManager,
    is_prefill_checkpoint_valid,
    prefill_checkpoint_position,
)
from pagedkv.specs import KVCacheSpec, MambaSpec, cdiv

if TYPE_CHECKING:
    from pagedkv.request import Request

_OWN = object()  # "the manager's own retention interval"


class MambaAlignManager(MambaManager):
    """Mamba in cache mode "align": the state at each block boundary a step ends on is cached.

    The table has an entry per block position, but a step allocates a real block only for its
    last position (plus, on the first allocation, the speculative blocks); positions in
    between are null. The block written in the previous step (`last_state_block_idx`) is freed
    once the request is processed past it; so is every real block before the last computed
    token. The scheduler ends prefill chunks on block boundaries, so each full real block holds
    the state at its end and is prefix-cached like an attention block.

    A state hashed in the current step is written only when the step runs: a hit on it makes
    `get_num_blocks_to_allocate` report more blocks than the pool has, so the request waits
    for the next step (`cached_hashes_this_step`, cleared by `new_step_starts`).

    Prefill checkpoints (`MambaSpec.num_prefill_checkpoint_blocks`, vLLM 0.33): a chunk
    that ends past the prompt's reusable boundary (`prefill_checkpoint_position`) and can export
    the state there keeps the block at that boundary's column real instead of null
    (`_checkpoints[r] = (position, column)`), so the state a resend of the prompt resumes at is
    cached although no chunk ends there. A checkpoint that is neither the prompt's boundary,
    nor kept by the retention mask, nor the shared-prefix junction is transient: its entry is
    evicted again. `prefill_end` (the coordinator passes it only with retention interval 0)
    restricts checkpoints to the chunk reaching it. pagedkv's hits are scheduler-block aligned,
    so the boundary is always a block boundary.

    Boundary-state hand-offs (vLLM 0.33's, for a KV connector that offloads Mamba states):
    with `record_boundary_state_offloads` on (the vLLM drop-in sets it), every state block
    `cache_blocks` newly caches is offered as `(request_id, group_id, block, boundary_tokens)`
    until `take_pending_boundary_state_offloads` drains it (vLLM's scheduler does every step;
    offers made between steps, by `cache_blocks` from `update_from_output`, wait for the next
    take); freeing a request withdraws its offers, as its blocks go back to the pool.

    Sub-block (partial) hits (vLLM 0.33; the hybrid coordinator enables them when every
    cacheable group can look up at hash-block granularity): a hit may resume at any hash
    boundary, the state there sitting in the block of its position; a hit that ends inside a
    block is copied into a private block (the base class's copy-on-write). The state at the
    prompt's last reusable hash boundary is entered as a sub-block entry of the block holding
    it; a running request that entered one stays on its block and the cache's keys move to a
    copy (`_preserve_own_tail`).
    """

    def __init__(self, kv_cache_spec: KVCacheSpec, *args: Any, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, *args, **kwargs)
        # Request -> position of the state block written in the previous step.
        self.last_state_block_idx: dict[str, int] = {}
        # Request -> positions below this are already nulled and freed.
        self._num_retired_blocks: dict[str, int] = {}
        # Requests that got fresh blocks at least once (their speculative blocks exist).
        self._allocated_block_reqs: set[str] = set()
        self.cached_hashes_this_step: set[BlockHash] = set()
        spec = cast(MambaSpec, kv_cache_spec)
        self.has_prefill_checkpoint_blocks = spec.num_prefill_checkpoint_blocks > 0
        self.prefill_checkpoint_alignment = spec.prefill_checkpoint_alignment
        # Set by the coordinator with EAGLE: checkpoints follow its replay boundary.
        self.drop_eagle_checkpoint_block = False
        # Request -> (checkpoint position, column) reserved by the current allocation.
        self._checkpoints: dict[str, tuple[int, int]] = {}
        self.record_boundary_state_offloads = False
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        # vLLM's `enable_mamba_shared_prefix_checkpoint`, narrowed by the KVCacheManager: also
        # enter the state at an observed shared-prefix junction as a sub-block entry.
        self.shared_prefix_checkpoint = False
        # Requests that entered their own prompt's tail state as a sub-block entry (request ->
        # (block, boundary tokens)): the copy made before their next step preserves it.
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    def _needs_internal_checkpoint(
        self, request_id: str, query_start: int, query_end: int, position: int, prefill_end: int
    ) -> bool:
        column = cdiv(query_end, self.block_size) - 2
        blocks = self.req_to_blocks.get(request_id, EMPTY_BLOCK_LIST)
        return (
            self.has_prefill_checkpoint_blocks
            and query_end >= prefill_end
            and is_prefill_checkpoint_valid(
                query_start,
                query_end,
                position,
                self.block_pool.hash_block_size,
                self.block_size,
                self.prefill_checkpoint_alignment,
            )
            and column >= 0
            and (
                column >= len(blocks)
                or blocks[column] is self._null_block
                or (
                    request_id in self._allocated_block_reqs
                    and column >= len(blocks) - self.num_speculative_blocks
                )
            )
        )

    def _checkpoint_position(self, num_tokens: int) -> int:
        return prefill_checkpoint_position(
            num_tokens,
            self.alignment_tokens,
            self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens,
        )

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        apply_admission_cap: bool = False,
        num_tokens_main_model: int | None = None,
        prefill_end: int = 0,
        num_local_computed_tokens: int = 0,
    ) -> int:
        """Blocks this step takes: at most one (plus the speculative ones the first time, a
        prefill checkpoint's, and a sub-block hit's copy), recording the step's checkpoint
        unless `apply_admission_cap`.

        Lookahead (draft) tokens get no state block: draft models have no Mamba layers.
        """
        if new_computed_blocks and new_computed_blocks[-1].block_hash in (
            self.cached_hashes_this_step
        ):
            # More than the pool holds: the hit's state is written only when this step runs.
            return self.block_pool.num_gpu_blocks + 1
        if num_tokens_main_model is not None:
            num_tokens = num_tokens_main_model
        req_blocks = self.req_to_blocks.get(request_id, EMPTY_BLOCK_LIST)
        num_new = (
            cdiv(num_tokens, self.block_size)
            + self.num_speculative_blocks
            - len(new_computed_blocks)
            - len(req_blocks)
        )
        has_partial_hit = bool(
            new_computed_blocks and num_local_computed_tokens % self.block_size
        ) or (bool(self._partial_hit_reqs) and request_id in self._partial_hit_reqs)
        if has_partial_hit:
            num_new = max(num_new, 0) + 1
        checkpoint_block = 0
        if self.has_prefill_checkpoint_blocks:
            position = self._checkpoint_position(num_tokens)
            if self._needs_internal_checkpoint(
                request_id, total_computed_tokens, num_tokens, position, prefill_end
            ):
                checkpoint_block = 1
                if not apply_admission_cap:
                    column = cdiv(num_tokens, self.block_size) - 2
                    self._checkpoints[request_id] = (position, column)
            elif not apply_admission_cap:
                self._checkpoints.pop(request_id, None)
        if num_new > 0:
            cap = 1 if request_id in self._allocated_block_reqs else 1 + self.num_speculative_blocks
            num_new = min(num_new, cap + has_partial_hit + checkpoint_block)
        null_block = self._null_block
        num_evictable = sum(
            1 for block in new_computed_blocks if block.ref_cnt == 0 and block is not null_block
        )
        return num_new + num_evictable

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """Null-pad to the step's last position and give it (and new speculative slots) blocks.

        Returns the table's new entries, nulls and relocated speculative blocks included: a
        worker's block table only grows, so it must see every position.
        """
        if num_tokens_main_model is not None:
            num_tokens = num_tokens_main_model
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_spec = self.num_speculative_blocks
        num_required = cdiv(num_tokens, self.block_size) + num_spec
        checkpoint_block = 1 if request_id in self._checkpoints else 0
        partial_hit = self._partial_hit_reqs.get(request_id)
        if partial_hit is not None:
            self._check_shared_tail(request_id, *partial_hit)  # before any block moves
            del self._partial_hit_reqs[request_id]
        if num_required <= len(req_blocks) and partial_hit is None and not checkpoint_block:
            self._allocated_block_reqs.add(request_id)
            return EMPTY_BLOCK_LIST
        num_before = len(req_blocks)
        allocated_before = request_id in self._allocated_block_reqs
        if allocated_before:
            self.last_state_block_idx[request_id] = num_before - 1 - num_spec
        elif num_before:
            self.last_state_block_idx[request_id] = num_before - 1  # the hit's state block
        num_skipped = num_required - num_spec - 1
        null_block = self._null_block
        # A checkpoint's column (the one before the last) stays real: the worker exports the
        # boundary state into it.
        null_end = num_skipped - checkpoint_block
        if num_before < null_end:
            req_blocks.extend([null_block] * (null_end - num_before))
        if allocated_before:
            # Speculative blocks this step leaves behind move to the end of the table.
            for index in range(num_before - num_spec, min(num_before, null_end)):
                req_blocks.append(req_blocks[index])
                req_blocks[index] = null_block
        num_new = max(num_required - len(req_blocks), 0)
        if partial_hit is not None:
            num_new += 1  # the shared state's private copy
        returned = req_blocks[num_before:]
        new_blocks = self.block_pool.get_new_blocks(num_new)
        if partial_hit is not None:
            position, source = partial_hit
            copy = new_blocks.pop(0)
            if allocated_before:
                self._preserve_own_tail(request_id, source, copy)
            else:
                self._apply_cow(request_id, position, source, copy)
                returned.insert(0, copy)
        req_blocks.extend(new_blocks)
        self._allocated_block_reqs.add(request_id)
        returned.extend(new_blocks)
        return returned

    def _preserve_own_tail(self, request_id: str, source: KVCacheBlock, copy: KVCacheBlock) -> None:
        """A running request's own sub-block entry: its table only grows, so it stays on
        `source` (which its next step overwrites) and the cache's keys move to `copy`, which
        the queued copy fills first. `source` keeps one more reference until then; `copy` is
        held by the copy alone."""
        self.block_pool.move_block_hashes(source, copy)
        self._pending_cow_copies.append((source, copy))
        source.ref_cnt += 1
        producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer_tail is not None and self.record_boundary_state_offloads:
            # The copy preserves the producer's boundary state: a connector may offload it.
            self._pending_boundary_state_offloads.append(
                (request_id, self.kv_cache_group_id, copy, producer_tail[1])
            )
        if copy.block_hash is not None:
            # Filled only when this step runs: no same-step hit may use it.
            self.cached_hashes_this_step.add(copy.block_hash)

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free every real block before the last computed token, and the previous state.

        Freed in reverse (the longer prefix first, so it is evicted first); positions below
        `_num_retired_blocks` were handled before and are not walked again.
        """
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        null_block = self._null_block
        num_skipped_blocks = min(
            self.get_num_skipped_tokens(num_computed_tokens) // self.block_size, len(blocks)
        )
        first = self._num_retired_blocks.get(request_id, 0)
        if first < num_skipped_blocks:
            removed = []
            for index in range(num_skipped_blocks - 1, first - 1, -1):
                block = blocks[index]
                if block is not null_block:
                    removed.append(block)
                    blocks[index] = null_block
            if removed:
                self.block_pool.free_blocks(removed)
            self._num_retired_blocks[request_id] = num_skipped_blocks
        last_state = self.last_state_block_idx.get(request_id)
        if (
            last_state is not None
            and last_state < cdiv(num_computed_tokens, self.block_size) - 1
            and blocks[last_state] is not null_block
        ):
            self.block_pool.free_blocks([blocks[last_state]])
            blocks[last_state] = null_block

    def cache_blocks(
        self, request: Request, num_tokens: int, replay_boundaries: Sequence[int] = ()
    ) -> None:
        """Cache the full state blocks, remembering their hashes for the same-step rule; then
        the step's prefill checkpoint (where a later hit can resume at it) or the prompt's
        tail state as a sub-block entry (`_cache_partial_tail_block`)."""
        request_id = request.request_id
        num_before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens, replay_boundaries)
        num_after = self.num_cached_block.get(request_id, 0)
        partial_hash = self._cache_partial_tail_block(request, num_tokens)
        if partial_hash is not None:
            self.cached_hashes_this_step.add(partial_hash)
        if num_after > num_before:
            null_block = self._null_block
            offers = (
                self._pending_boundary_state_offloads
                if self.record_boundary_state_offloads
                else None
            )
            blocks = self.req_to_blocks[request_id]
            for index in range(num_before, num_after):
                block = blocks[index]
                if block is not null_block and block.block_hash is not None:
                    self.cached_hashes_this_step.add(block.block_hash)
                    if offers is not None:
                        # The exact boundary the block's state is at.
                        offers.append(
                            (request_id, self.kv_cache_group_id, block, block.hash_num_tokens)
                        )

    def _cache_partial_tail_block(
        self, request: Request, num_tokens: int, retention_interval: object = _OWN
    ) -> BlockHash | None:
        """Key the step's checkpoint block at its boundary (or evict it if it is transient);
        without a checkpoint, enter the state at the prompt's last reusable hash boundary (or
        at the shared-prefix junction) as a sub-block entry of the block holding it. Returns
        the key entered, if any (vLLM 0.33's rules; vLLM's tests pass `retention_interval`,
        which defaults to the manager's)."""
        interval = self.retention_interval if retention_interval is _OWN else retention_interval
        request_id = request.request_id
        blocks = self.req_to_blocks[request_id]
        pool = self.block_pool
        checkpoint = self._checkpoints.get(request_id)
        if checkpoint is not None:
            position, column = checkpoint
            block = blocks[column]
            is_prompt_checkpoint = position == self._checkpoint_position(request.num_prompt_tokens)
            is_retained = position % self.block_size == 0 and self._keeps_state_at(
                position // self.block_size - 1, cast("int | None", interval)
            )
            if (
                not is_prompt_checkpoint
                and not is_retained
                and position != request.shared_prefix_boundary
            ):
                # The transient state is overwritten in this block: no hit may resume at it.
                pool._maybe_evict_cached_block(block)
                return None
            if block.block_hash_num_tokens == position:
                return None
            return pool.cache_partial_block(
                request,
                block,
                position,
                self.kv_cache_group_id,
                self.block_size,
                replace_existing_hashes=True,
            )
        hash_block_size = pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hash_block_size:
            return None
        prompt_boundary = prefill_checkpoint_position(
            request.num_prompt_tokens,
            hash_block_size,
            self.drop_eagle_checkpoint_block,
            pool.num_hash_lookahead_tokens,
        )
        # The junction is the other position a sibling resumes at; only within the prompt
        # chunk being computed (a decode step overwrites the running state block in place).
        if num_tokens != prompt_boundary and not (
            self.shared_prefix_checkpoint
            and num_tokens == request.shared_prefix_boundary
            and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens
        ):
            return None
        position = cdiv(num_tokens, self.block_size) - 1
        if position >= len(blocks):
            return None
        source = blocks[position]
        if source is self._null_block or source.block_hash_num_tokens == num_tokens:
            return None
        partial_hash = pool.cache_partial_block(
            request, source, num_tokens, self.kv_cache_group_id, self.block_size
        )
        if partial_hash is not None and num_tokens % self.block_size:
            # The state lives in `source`, which the request's next step overwrites: that
            # allocation copies it out first (`_preserve_own_tail`).
            self._partial_hit_reqs[request_id] = (position, source)
            self.num_cached_block[request_id] = position
            self._producer_partial_tail_reqs[request_id] = (source, num_tokens)
        return partial_hash

    def _keeps_state_at(self, position: int, interval: int | None) -> bool:
        """Whether retention `interval` keeps the state ending block `position` (the
        interval's segment states only; no replay boundaries)."""
        if interval is None:
            return True
        per_segment = interval // self.block_size
        if interval and per_segment <= 1:
            return True
        return bool(interval) and (position + 1) % per_segment == 0

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """A finishing producer's own tail state, if no later token was forwarded over it:
        `(group_id, block, boundary_tokens)` for a connector to offload before the free."""
        producer_tail = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer_tail is None:
            return None
        block, boundary_tokens = producer_tail
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary_tokens:
            return None
        return self.kv_cache_group_id, block, boundary_tokens

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """Drain the boundary states offered since the last call, oldest first."""
        pending = self._pending_boundary_state_offloads
        self._pending_boundary_state_offloads = []
        return pending

    def _withdraw_offers(self, request_id: str) -> None:
        # The request's blocks go back to the pool: a connector must not claim them.
        if self._pending_boundary_state_offloads:
            self._pending_boundary_state_offloads = [
                offer for offer in self._pending_boundary_state_offloads if offer[0] != request_id
            ]

    def reachable_block_mask(
        self,
        request: Request,
        start_block: int,
        end_block: int,
        replay_boundaries: Sequence[int],
    ) -> list[bool] | None:
        """With a retention interval, only boundary states a later hit can use are cached.

        Interval N > 0: the state ending each N-token segment; 0: none of those. Either way,
        the states at the replay boundaries and at the shared-prefix boundary. None (cache
        every state) without an interval, or when every block ends a segment.
        """
        interval = self.retention_interval
        if interval is None:
            return None
        block_size = self.block_size
        mask = [False] * (end_block - start_block)
        if interval:
            per_segment = interval // block_size
            if per_segment <= 1:
                return None
            first = (start_block + per_segment) // per_segment * per_segment - 1
            for index in range(first - start_block, len(mask), per_segment):
                mask[index] = True
        boundaries = list(replay_boundaries)
        junction = request.shared_prefix_boundary
        if junction:
            boundaries.append(junction)
            if self.use_eagle:
                boundaries.append(junction - block_size)
        alignment_tokens = self.alignment_tokens
        for boundary in boundaries:
            block_index = boundary // alignment_tokens * alignment_tokens // block_size - 1
            if start_block <= block_index < end_block:
                mask[block_index - start_block] = True
        return mask

    def _forget_request(self, request_id: str) -> None:
        """Drop the request's per-request state (its blocks go back to the pool next)."""
        self._withdraw_offers(request_id)
        self._producer_partial_tail_reqs.pop(request_id, None)
        self._checkpoints.pop(request_id, None)
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        self._num_retired_blocks.pop(request_id, None)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._forget_request(request_id)
        return super().pop_blocks_for_free(request_id)

    def free(self, request_id: str) -> None:
        self._forget_request(request_id)
        super().free(request_id)

    def new_step_starts(self) -> None:
        self.cached_hashes_this_step.clear()
