"""Per-attention-type manager base: one per KV-cache group, it owns the group's block tables.

A manager knows how many blocks a request needs, which are skippable (outside a window), which
may be cached and how to find a prefix hit. It draws blocks from the shared `BlockPool`.
"""

from __future__ import annotations

from _thread import get_ident
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.errors import InvariantViolation
from pagedkv.hashing import resolve_block_hashes
from pagedkv.specs import KVCacheSpec, cdiv

if TYPE_CHECKING:
    from pagedkv.request import Request

EMPTY_BLOCK_LIST: list[KVCacheBlock] = []  # shared; never mutated


class SingleTypeKVCacheManager:
    """Block tables of one KV-cache group.

    Invariants: `req_to_blocks[r]` is request r's block table in position order (null blocks
    stand for skipped positions); `num_cached_block[r]` counts r's leading blocks already in
    the prefix cache (null padding included) and is present once r has been allocated;
    `new_block_ids` (None unless recording) lists blocks allocated since the last drain.
    `use_eagle` is set by the coordinator: this group's hits drop the EAGLE block.

    Sub-block (partial) hits (vLLM 0.33, only where the coordinator enables them): a hit that
    ends inside one of this group's blocks shares that block's head with the cache, so the
    request writes into a private copy instead (copy-on-write). `add_local_computed_blocks`
    records the shared tail in `_partial_hit_reqs[r] = (position, block)` and caches only the
    blocks before it; the next `allocate_new_blocks` takes a fresh block for the position,
    tables it and queues `(source, copy)` in `_pending_cow_copies` (drained by
    `take_pending_cow_copies`). Until the copy has run both blocks keep one extra reference
    (the source its hit's, the copy one more than its table's), which the caller drops with
    `BlockPool.free_blocks` once the worker copied. `registers_partial_tails` (set by the
    coordinator for a full-attention group whose blocks are larger than a hash block) enters
    the hash boundary the prompt ends at as a sub-block entry of the block holding it.
    """

    # Whether hits may end inside a block (vLLM's `supports_fine_grained_hash_lookup`).
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool = True,
        max_admission_blocks_per_request: int | None = None,
        alignment_tokens: int | None = None,
        retention_interval: int | None = None,
        record_new_block_ids: bool = False,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.alignment_tokens = alignment_tokens or kv_cache_spec.block_size
        self.retention_interval = retention_interval
        self.use_eagle = False
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.new_block_ids: list[int] | None = [] if record_new_block_ids else None
        self._null_block = block_pool.null_block
        self.registers_partial_tails = False
        # Context-parallel ranks this group's blocks are sharded over (set by the coordinator;
        # `block_size` already counts all of them).
        self.dcp_world_size = 1
        self.pcp_world_size = 1
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []

    @property
    def cache_hit_alignment_tokens(self) -> int:
        """vLLM 0.33's name of `alignment_tokens` (its tests and Mamba checkpoints read it)."""
        return self.alignment_tokens

    # ------------------------------------------------------------------ counting

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV is no longer needed once `num_computed_tokens` are done."""
        return 0

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
        """Blocks to take from the free pool to hold `num_tokens`, counting evictable hits
        (and the copy of a hit's shared tail, when `num_local_computed_tokens`, the prefix
        hit, ends inside a block).

        `num_tokens_main_model` excludes lookahead (draft) slots and `prefill_end` is where the
        request's prefill ends; only Mamba "align" uses them.
        """
        required = cdiv(num_tokens, self.block_size)
        cap = self.max_admission_blocks_per_request
        if apply_admission_cap and cap is not None and required > cap:
            required = cap
        req_blocks = self.req_to_blocks.get(request_id, EMPTY_BLOCK_LIST)
        if request_id in self.num_cached_block:
            # A running request: hits were adopted when it was admitted.
            return max(required - len(req_blocks), 0)
        skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(required - max(skipped_blocks, len(new_computed_blocks) + len(req_blocks)), 0)
        # Hit blocks nobody holds sit in the free queue: touching them takes them out of it.
        first_kept = max(skipped_blocks - len(req_blocks), 0)
        null_block = self._null_block
        num_evictable = 0
        for block in new_computed_blocks[first_kept:]:
            if block.ref_cnt == 0 and block is not null_block:
                num_evictable += 1
        if new_computed_blocks and num_local_computed_tokens % self.block_size:
            num_new += 1  # the shared tail's private copy
        return num_new + num_evictable

    # ------------------------------------------------------------------ allocation

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adopt prefix-hit blocks of a request that holds none: touch them, table them.

        Positions no longer needed once the local and external tokens are computed (outside a
        window) become the null block, even past the hits; the kept hits follow.
        """
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_skipped_tokens = self.get_num_skipped_tokens(
            num_local_computed_tokens + num_external_computed_tokens
        )
        num_skipped_blocks = num_skipped_tokens // self.block_size
        kept = new_computed_blocks[num_skipped_blocks:]
        self.block_pool.touch(kept)
        if num_skipped_blocks:
            req_blocks.extend([self._null_block] * num_skipped_blocks)
        req_blocks.extend(kept)
        self.num_cached_block[request_id] = len(req_blocks)
        if kept and num_local_computed_tokens % self.block_size:
            # The hit ends inside its last block: the next allocation copies it (see above).
            position = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (position, kept[-1])
            self.num_cached_block[request_id] = position

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Allocate blocks for tokens a KV connector loads (those still inside the window).

        Phase two of admission, after every group adopted its hits, so no group's allocation
        can evict another group's hit that is not adopted yet.
        """
        num_total_tokens = num_local_computed_tokens + num_external_computed_tokens
        num_skipped_tokens = self.get_num_skipped_tokens(num_total_tokens)
        if num_skipped_tokens > 0:
            num_external_computed_tokens = min(
                num_total_tokens - num_skipped_tokens, num_external_computed_tokens
            )
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = max(0, cdiv(num_total_tokens, self.block_size) - len(req_blocks))
        if num_new:
            new_blocks = self.block_pool.get_new_blocks(num_new)
            req_blocks.extend(new_blocks)
            if record_for_zeroing and self.new_block_ids is not None:
                self.new_block_ids.extend(block.block_id for block in new_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int | None = None
    ) -> list[KVCacheBlock]:
        """Append fresh blocks so the table covers `num_tokens`; return only the new ones
        (first the private copy of a sub-block hit's shared tail, if one is due)."""
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            return self._allocate_with_copy(request_id, num_tokens)
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        num_new = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if num_new <= 0:
            return EMPTY_BLOCK_LIST
        new_blocks = self.block_pool.get_new_blocks(num_new)
        req_blocks.extend(new_blocks)
        if self.new_block_ids is not None:
            self.new_block_ids.extend(block.block_id for block in new_blocks)
        return new_blocks

    def _allocate_with_copy(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """`allocate_new_blocks` for a request whose hit ends inside a block: the shared tail
        is replaced in the table by a private copy first (counted by
        `get_num_blocks_to_allocate`)."""
        position, source = self._partial_hit_reqs[request_id]
        self._check_shared_tail(request_id, position, source)  # before any block moves
        del self._partial_hit_reqs[request_id]
        copy = self.block_pool.get_new_blocks(1)[0]
        self._apply_cow(request_id, position, source, copy)
        if self.new_block_ids is not None:
            self.new_block_ids.append(copy.block_id)
        return [copy, *self.allocate_new_blocks(request_id, num_tokens)]  # the plain path now

    def _apply_cow(
        self, request_id: str, position: int, source: KVCacheBlock, copy: KVCacheBlock
    ) -> None:
        """Table `copy` at `position` instead of the shared `source` (the caller checked it is
        there, `_check_shared_tail`) and queue the copy; both keep a reference until it has run
        (`source` its hit's, `copy` one more)."""
        self.req_to_blocks[request_id][position] = copy
        self._pending_cow_copies.append((source, copy))
        copy.ref_cnt += 1

    def _check_shared_tail(self, request_id: str, position: int, source: KVCacheBlock) -> None:
        req_blocks = self.req_to_blocks.get(request_id, EMPTY_BLOCK_LIST)
        if position >= len(req_blocks) or req_blocks[position] is not source or source.ref_cnt <= 0:
            raise InvariantViolation(
                f"request {request_id!r}: position {position} no longer holds its hit's "
                f"block {source.block_id}"
            )

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Drain the `(source, copy)` pairs queued since the last call, oldest first; the
        caller copies each source block's contents into its copy, then frees both once."""
        pending = self._pending_cow_copies
        if not pending:
            return []
        self._pending_cow_copies = []
        return pending

    def take_new_block_ids(self) -> list[int]:
        """Drain the ids of blocks allocated since the last call (empty unless recording)."""
        ids = self.new_block_ids
        if not ids:
            return []
        self.new_block_ids = []
        return ids

    def get_num_cacheable_blocks(self, request: Request, num_tokens: int) -> int:
        """Full blocks of the first `num_tokens` tokens that have hashes.

        A request's hashes may lag its tokens (with hash lookahead a block is hashed only once
        the tokens after it exist): only blocks with a hash can be cached.
        """
        num_hashed_tokens = len(request.block_hashes) * self.block_pool.hash_block_size
        if num_hashed_tokens < num_tokens:
            num_tokens = num_hashed_tokens
        return num_tokens // self.block_size

    def cache_blocks(
        self, request: Request, num_tokens: int, replay_boundaries: Sequence[int] = ()
    ) -> None:
        """Enter the request's full, hashed blocks up to `num_tokens` into the prefix cache.

        `replay_boundaries`: token positions a later request can resume at; a sparse-retention
        manager keeps the blocks a hit there needs (`reachable_block_mask`).
        """
        request_id = request.request_id
        num_cached = self.num_cached_block.get(request_id, 0)
        num_full = self.get_num_cacheable_blocks(request, num_tokens)
        if num_full <= num_cached:
            if self.registers_partial_tails:
                self._enter_prompt_tail(request, num_tokens)
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks[request_id],
            self.resolve_hashes(request.block_hashes),
            num_cached,
            num_full,
            self.block_size,
            self.kv_cache_group_id,
            self.reachable_block_mask(request, num_cached, num_full, replay_boundaries),
        )
        self.num_cached_block[request_id] = num_full
        if self.registers_partial_tails:
            self._enter_prompt_tail(request, num_tokens)

    def _enter_prompt_tail(self, request: Request, num_tokens: int) -> None:
        """Enter the last hash boundary a resend of the prompt can hit (all but its last token;
        with EAGLE the whole prompt, as its hits drop a hash block) as a sub-block entry of
        the block holding it, once `num_tokens` reach it (vLLM 0.33's full-attention rule)."""
        hash_block_size = self.block_pool.hash_block_size
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hash_block_size, len(request.block_hashes)) * hash_block_size
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        blocks = self.req_to_blocks[request.request_id]
        position = boundary // self.block_size
        if position < len(blocks):
            self.block_pool.cache_partial_block(
                request,
                blocks[position],
                boundary,
                self.kv_cache_group_id,
                self.block_size,
                parent=blocks[position - 1] if position else None,
            )

    def reachable_block_mask(
        self,
        request: Request,
        start_block: int,
        end_block: int,
        replay_boundaries: Sequence[int],
    ) -> list[bool] | None:
        """Which of blocks [start_block, end_block) a later hit can use; None: all of them.

        Dense by default; sparse-retention managers (sliding window) keep only some.
        """
        return None

    def resolve_hashes(self, block_hashes: Sequence[BlockHash]) -> Sequence[BlockHash]:
        """The request's hashes at this group's block size."""
        return resolve_block_hashes(block_hashes, self.block_pool.hash_block_size, self.block_size)

    # ------------------------------------------------------------------ freeing

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (so a prefix's tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request_id, None)
        self.num_cached_block.pop(request_id, None)
        if self._partial_hit_reqs:
            self._partial_hit_reqs.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request's table and return its blocks (in order) for a deferred free."""
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, [])

    def remove_skipped_blocks(
        self, request_id: str, num_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Replace no longer needed blocks by the null block; free them, longest prefix first.

        `num_prompt_tokens` is for managers that free a middle range (R-SWA's gap); the
        others skip a leading range and ignore it."""
        num_skipped_tokens = self.get_num_skipped_tokens(num_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        self._null_range(blocks, 0, min(num_skipped_tokens // self.block_size, len(blocks)))

    def _null_range(self, blocks: list[KVCacheBlock], first: int, last: int) -> None:
        """Replace `blocks[first:last]` by the null block and free them, walking back from the
        last: everything before a null is already null (a range is freed once, newest first)."""
        # Before the table changes. Hot path: a window moves on the decode fast path too.
        owner = self.block_pool.owner_thread
        if get_ident() != owner.thread_id:
            owner.check("remove_skipped_blocks")
        null_block = self._null_block
        removed = []
        for index in range(last - 1, first - 1, -1):
            block = blocks[index]
            if block is null_block:
                break
            removed.append(block)
            blocks[index] = null_block
        if removed:
            self.block_pool.free_blocks(removed)

    # ------------------------------------------------------------------ hits

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        alignment_tokens: int,
        drop_eagle_block: bool = False,
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Longest cached prefix of at most `max_length` tokens valid in every listed group.

        With `drop_eagle_block` the last matched block is dropped (an EAGLE drafter must
        recompute it). Returns the hit blocks per group and the hit length in tokens (a
        multiple of `alignment_tokens`).
        """
        raise NotImplementedError

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of the request shared by every request holding blocks (cascade)."""
        return 0

    def new_step_starts(self) -> None:
        """Called at the start of each scheduler step."""

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Per-group checks; ref counts across groups are checked by the coordinator."""
        for request_id, blocks in self.req_to_blocks.items():
            num_cached = self.num_cached_block.get(request_id, 0)
            if num_cached > len(blocks):
                raise InvariantViolation(
                    f"group {self.kv_cache_group_id}: request {request_id!r} has "
                    f"num_cached_block {num_cached} > {len(blocks)} blocks"
                )
            for index, block in enumerate(blocks):
                if block is self._null_block:
                    continue
                if self.block_pool.blocks[block.block_id] is not block:
                    raise InvariantViolation(f"request {request_id!r} holds a foreign block")
                if block.ref_cnt <= 0:
                    raise InvariantViolation(
                        f"request {request_id!r} holds block {block.block_id} with ref_cnt "
                        f"{block.ref_cnt}"
                    )
                # Blocks past num_cached_block were allocated fresh for this request and are
                # not cached yet, but for a sub-block entry of the prompt's tail. (Blocks
                # before it may have lost their hash to evict_blocks.)
                if (
                    index >= num_cached
                    and block.block_hash is not None
                    and block.ref_cnt == 1
                    and block.hash_num_tokens >= (index + 1) * self.block_size
                ):
                    raise InvariantViolation(
                        f"request {request_id!r}: block {block.block_id} at {index} >= "
                        f"num_cached_block {num_cached} is cached but held only by it"
                    )
