"""Coordinator layer: fast paths for a running request's next tokens (decode, next prompt chunk).

A request that already holds blocks and passes none of `allocate_slots`' optional arguments
needs no hit handling, watermark or admission cap: only window frees, a count, new blocks and
caching. The general path does each stage as a fan-out over every group; these allocators do
them in one pass, with the same result. `make_running_allocator` picks one at construction
(or none, and the facade keeps the general path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal

from pagedkv.coordinators.base import KVCacheCoordinator
from pagedkv.kv_cache_blocks import DecodeSlots, KVCacheBlocks
from pagedkv.managers import FullAttentionManager, SingleTypeKVCacheManager
from pagedkv.managers.base import EMPTY_BLOCK_LIST

if TYPE_CHECKING:
    from pagedkv.request import Request

# The manager steps an allocator replays; a manager class overriding any of them keeps the
# general path (its override is then the only source of truth).
_REPLAYED_STEPS = (
    "remove_skipped_blocks",
    "get_num_blocks_to_allocate",
    "allocate_new_blocks",
    "cache_blocks",
    "free",
)
_BASE = SingleTypeKVCacheManager


def _replays_base_steps(manager: SingleTypeKVCacheManager) -> bool:
    return all(getattr(type(manager), step) is getattr(_BASE, step) for step in _REPLAYED_STEPS)


class RunningAllocator:
    """Allocation for running requests (validated by the facade) without the general path.

    Contract: `allocate(request, n, cache)` has exactly the effect and result of
    `KVCacheManager.allocate_slots(request, n)` for a running request holding blocks (with
    `delay_cache_blocks=not cache`), given `num_computed_tokens + n <= max_model_len`;
    `allocate_decode(requests, start, cache)` that of one such call with `n = 1` per request
    from `start`, stopping at the first that does not fit; `free(request_id)` that of the
    coordinator's `free`.
    """

    __slots__ = ("block_pool", "empty", "tables")

    def __init__(self, coordinator: KVCacheCoordinator, empty: KVCacheBlocks) -> None:
        self.block_pool = coordinator.block_pool
        self.empty = empty
        self.tables = tuple(
            (manager.req_to_blocks, manager.num_cached_block)
            for manager in coordinator.single_type_managers
        )

    def free(self, request_id: str) -> None:
        """Release the request's blocks, group by group, each table last block first."""
        free_blocks = self.block_pool.free_blocks
        null_block = self.block_pool.null_block
        # Hot path: the coordinator's fan-out and the base manager's `free`, without the two
        # method calls per group.
        for req_to_blocks, num_cached_block in self.tables:
            blocks = req_to_blocks.pop(request_id, None)
            num_cached_block.pop(request_id, None)
            if not blocks:
                continue
            if blocks[0] is null_block:
                # Hot path: a windowed table starts with the nulls of the positions that left
                # the window (often half of it); counted in C and left out, the pool need not
                # skip them one by one. Only if they really are the prefix.
                num_null = blocks.count(null_block)
                if blocks[:num_null].count(null_block) == num_null:
                    free_blocks(blocks[: num_null - 1 : -1])
                    continue
            free_blocks(blocks[::-1])

    def allocate(self, request: Request, num_new_tokens: int, cache: bool) -> KVCacheBlocks | None:
        raise NotImplementedError

    def allocate_decode(self, requests: Sequence[Request], start: int, cache: bool) -> DecodeSlots:
        """One slot for each request from `start`, in order; stop at the first that does not fit."""
        allocate = self.allocate
        empty = self.empty
        with_new_blocks: list[Request] = []
        for index in range(start, len(requests)):
            request = requests[index]
            result = allocate(request, 1, cache)
            if result is None:
                return DecodeSlots(index - start, with_new_blocks)
            if result is not empty:
                with_new_blocks.append(request)
        return DecodeSlots(len(requests) - start, with_new_blocks)


class SingleGroupRunningAllocator(RunningAllocator):
    """One full-attention group (the common case): no window, no hybrid rounding."""

    __slots__ = ("manager", "block_size")

    def __init__(self, coordinator: KVCacheCoordinator, empty: KVCacheBlocks) -> None:
        super().__init__(coordinator, empty)
        (self.manager,) = coordinator.single_type_managers
        self.block_size = self.manager.block_size

    def allocate(self, request: Request, num_new_tokens: int, cache: bool) -> KVCacheBlocks | None:
        total_tokens = request.num_computed_tokens + num_new_tokens
        manager = self.manager
        block_size = self.block_size
        blocks = manager.req_to_blocks[request.request_id]
        num_new_blocks = -(-total_tokens // block_size) - len(blocks)
        if num_new_blocks > 0:
            pool = self.block_pool
            if num_new_blocks > pool.free_block_queue.num_free_blocks:
                return None
            new_blocks = pool.get_new_blocks(num_new_blocks)
            blocks.extend(new_blocks)
            result = KVCacheBlocks((new_blocks,))
        else:
            result = self.empty
        if cache:
            num_tokens = request.num_tokens
            num_cacheable = total_tokens if total_tokens < num_tokens else num_tokens
            if num_cacheable // block_size > manager.num_cached_block.get(request.request_id, 0):
                manager.cache_blocks(request, num_cacheable)
        return result

    def free(self, request_id: str) -> None:
        manager = self.manager
        blocks = manager.req_to_blocks.pop(request_id, None)
        manager.num_cached_block.pop(request_id, None)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    def allocate_decode(self, requests: Sequence[Request], start: int, cache: bool) -> DecodeSlots:
        manager = self.manager
        block_size = self.block_size
        req_to_blocks = manager.req_to_blocks
        num_cached_block = manager.num_cached_block
        pool = self.block_pool
        free_queue = pool.free_block_queue
        num_requests = len(requests)
        with_new_blocks: list[Request] = []
        # Hot path: one request per iteration, a few attribute reads and one comparison in
        # the common case (the current block still has room).
        for index in range(start, num_requests):
            request = requests[index]
            request_id = request.request_id
            total_tokens = request.num_computed_tokens + 1
            blocks = req_to_blocks[request_id]
            if total_tokens > len(blocks) * block_size:
                if free_queue.num_free_blocks == 0:
                    return DecodeSlots(index - start, with_new_blocks)
                blocks.extend(pool.get_new_blocks(1))
                with_new_blocks.append(request)
            if cache:
                num_tokens = request.num_tokens
                num_cacheable = total_tokens if total_tokens < num_tokens else num_tokens
                if num_cacheable // block_size > num_cached_block.get(request_id, 0):
                    manager.cache_blocks(request, num_cacheable)
        return DecodeSlots(num_requests - start, with_new_blocks)


# Per group: the manager, its block size, its tables, its cached counts, and its window: None
# (no blocks leave), True (the allocator's shared window) or its own `get_num_skipped_tokens`.
_Window = Literal[True] | Callable[[int], int] | None
_GroupPlan = tuple[SingleTypeKVCacheManager, int, dict[str, list], dict[str, int], _Window]


class MultiGroupRunningAllocator(RunningAllocator):
    """Any groups whose managers replay the base steps (full, sliding-window, chunked-local).

    One pass over the groups frees blocks that left a window and counts new blocks (a group's
    count depends only on its own table, so interleaving the two stages per group changes
    nothing; the frees still happen in group order, before the fit check, as in the general
    path); the new blocks come from the pool in one call, handed out in group order; then every
    caching group caches its newly full blocks (rounded down like the coordinator's).

    `get_num_skipped_tokens` is a function of a manager's class and spec, so groups of the
    first windowed group's class and spec share one call (Gemma 3's five local groups, Llama
    4's chunked groups).
    """

    __slots__ = (
        "groups",
        "caching_groups",
        "cache_alignment_tokens",
        "null_block",
        "shared_window",
        "shared_block_size",
    )

    def __init__(self, coordinator: KVCacheCoordinator, empty: KVCacheBlocks) -> None:
        super().__init__(coordinator, empty)
        self.null_block = coordinator.block_pool.null_block
        self.cache_alignment_tokens = coordinator.cache_alignment_tokens
        self.shared_window: Callable[[int], int] | None = None
        self.shared_block_size = 1
        shared_key = None
        groups: list[_GroupPlan] = []
        for manager in coordinator.single_type_managers:
            window: _Window = None
            if type(manager).get_num_skipped_tokens is not _BASE.get_num_skipped_tokens:
                key = (type(manager), manager.kv_cache_spec)
                if shared_key is None:
                    shared_key = key
                    self.shared_window = manager.get_num_skipped_tokens
                    self.shared_block_size = manager.block_size
                window = True if key == shared_key else manager.get_num_skipped_tokens
            groups.append(
                (
                    manager,
                    manager.block_size,
                    manager.req_to_blocks,
                    manager.num_cached_block,
                    window,
                )
            )
        self.groups: tuple[_GroupPlan, ...] = tuple(groups)
        # (manager, cache when the cacheable tokens exceed this many blocks of it, its cached
        # counts). A group entering the prompt's tail as a sub-block entry is asked every time
        # (a count of 1-token blocks is always exceeded), as the general path asks it.
        self.caching_groups = tuple(
            (
                manager,
                1 if manager.registers_partial_tails else manager.block_size,
                manager.num_cached_block,
            )
            for manager in coordinator.single_type_managers
            if manager.enable_caching
        )

    def allocate(self, request: Request, num_new_tokens: int, cache: bool) -> KVCacheBlocks | None:
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        num_tokens = num_computed + num_new_tokens
        processed = num_computed - request.num_in_flight_tokens
        if processed < 0:
            processed = 0
        shared_window = self.shared_window
        shared_num_skipped = (
            shared_window(processed) // self.shared_block_size if shared_window is not None else 0
        )
        null_block = self.null_block
        num_to_allocate = 0  # what the general path counts (and checks against free blocks)
        num_new_blocks = 0  # what it then allocates
        # Hot path: stages 1 and 2 in one pass; a window moves one block every block_size
        # tokens, so the O(1) "already null" test skips the manager call in the common case.
        for manager, block_size, tables, num_cached, window in self.groups:
            blocks = tables.get(request_id, EMPTY_BLOCK_LIST)
            if window is not None and blocks:
                if window is True:
                    num_skipped = shared_num_skipped
                else:
                    num_skipped = window(processed) // block_size
                if num_skipped > 0:
                    if num_skipped > len(blocks):
                        num_skipped = len(blocks)
                    if blocks[num_skipped - 1] is not null_block:
                        manager.remove_skipped_blocks(request_id, processed)
            need = -(-num_tokens // block_size) - len(blocks)
            if need > 0:
                num_new_blocks += need
                if request_id in num_cached:
                    num_to_allocate += need
                else:  # not cached yet: the general count (it may differ for a windowed group)
                    num_to_allocate += manager.get_num_blocks_to_allocate(
                        request_id, num_tokens, EMPTY_BLOCK_LIST, num_computed
                    )
        if num_to_allocate > self.block_pool.free_block_queue.num_free_blocks:
            return None
        result = self.empty
        if num_new_blocks:
            result = self._take_new_blocks(
                request_id, num_tokens, num_new_blocks, num_new_blocks == num_to_allocate
            )
        if cache:
            self._cache(request, num_tokens)
        return result

    def _cache(self, request: Request, num_tokens: int) -> None:
        """Cache every caching group's newly full blocks, as the coordinator's cache_blocks."""
        num_cacheable = request.num_tokens
        if num_tokens < num_cacheable:
            num_cacheable = num_tokens
        alignment = self.cache_alignment_tokens
        num_cacheable = num_cacheable // alignment * alignment
        request_id = request.request_id
        for manager, block_size, num_cached in self.caching_groups:
            if num_cacheable // block_size > num_cached.get(request_id, 0):
                manager.cache_blocks(request, num_cacheable)

    def _take_new_blocks(
        self, request_id: str, num_tokens: int, num_new_blocks: int, counted: bool
    ) -> KVCacheBlocks:
        """Append each group's new blocks (one pool call, handed out in group order)."""
        if not counted:  # the general count differed: allocate exactly as the general path
            return KVCacheBlocks(
                tuple(group[0].allocate_new_blocks(request_id, num_tokens) for group in self.groups)
            )
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        per_group: list[list] = []
        offset = 0
        for _, block_size, tables, _, _ in self.groups:
            blocks = tables.get(request_id)
            if blocks is None:
                blocks = tables[request_id] = []
            need = -(-num_tokens // block_size) - len(blocks)
            if need > 0:
                part = new_blocks[offset : offset + need]
                offset += need
                blocks.extend(part)
                per_group.append(part)
            else:
                per_group.append(EMPTY_BLOCK_LIST)
        return KVCacheBlocks(tuple(per_group))

    def allocate_decode(self, requests: Sequence[Request], start: int, cache: bool) -> DecodeSlots:
        """`allocate` with one token per request, its common case inline.

        Per request, the window frees, the "does any group need a block" test and the caching
        run here; a request that needs blocks (one decode step in block_size) goes through
        `allocate`, whose window frees then find nothing left to free.
        """
        groups = self.groups
        caching_groups = self.caching_groups if cache else ()
        alignment = self.cache_alignment_tokens
        shared_window = self.shared_window
        shared_block_size = self.shared_block_size
        null_block = self.null_block
        allocate = self.allocate
        empty = self.empty
        with_new_blocks: list[Request] = []
        for index in range(start, len(requests)):
            request = requests[index]
            request_id = request.request_id
            num_computed = request.num_computed_tokens
            num_tokens = num_computed + 1
            processed = num_computed - request.num_in_flight_tokens
            if processed < 0:
                processed = 0
            shared_num_skipped = (
                shared_window(processed) // shared_block_size if shared_window is not None else 0
            )
            needs_blocks = False
            # Hot path: as in `allocate`, but only "does any group need a block?" is counted.
            for manager, block_size, tables, _, window in groups:
                blocks = tables.get(request_id, EMPTY_BLOCK_LIST)
                if window is not None and blocks:
                    if window is True:
                        num_skipped = shared_num_skipped
                    else:
                        num_skipped = window(processed) // block_size
                    if num_skipped > 0:
                        if num_skipped > len(blocks):
                            num_skipped = len(blocks)
                        if blocks[num_skipped - 1] is not null_block:
                            manager.remove_skipped_blocks(request_id, processed)
                if num_tokens > len(blocks) * block_size:
                    needs_blocks = True
            if needs_blocks:
                result = allocate(request, 1, cache)
                if result is None:
                    return DecodeSlots(index - start, with_new_blocks)
                if result is not empty:
                    with_new_blocks.append(request)
                continue
            num_cacheable = request.num_tokens
            if num_tokens < num_cacheable:
                num_cacheable = num_tokens
            num_cacheable = num_cacheable // alignment * alignment
            for manager, block_size, num_cached in caching_groups:
                if num_cacheable // block_size > num_cached.get(request_id, 0):
                    manager.cache_blocks(request, num_cacheable)
        return DecodeSlots(len(requests) - start, with_new_blocks)


def make_running_allocator(
    coordinator: KVCacheCoordinator, empty: KVCacheBlocks
) -> RunningAllocator | None:
    """The fast path for this configuration, or None where only the general path is exact."""
    managers = coordinator.single_type_managers
    if not managers or not all(_replays_base_steps(manager) for manager in managers):
        return None
    # Speculative decoding (EAGLE's per-group cacheable tokens, re-prefillable tokens), a
    # retention interval (replay boundaries) and the zeroing record change the steps replayed
    # here. (Sparse masks without an interval are the managers' own: `cache_blocks` applies them.)
    # Sub-block hits add a step (a copy) to allocation.
    if (
        coordinator.num_reprefillable_tokens
        or coordinator.enable_partial_hash_hits
        or coordinator.drop_eagle_group_ids
        or coordinator.wants_replay_boundaries
        or any(manager.use_eagle or manager.new_block_ids is not None for manager in managers)
    ):
        return None
    if not all(
        getattr(type(coordinator), step) is getattr(KVCacheCoordinator, step)
        for step in (
            "remove_skipped_blocks",
            "get_num_blocks_to_allocate",
            "allocate_new_blocks",
            "free",
        )
    ):
        return None
    if len(managers) == 1 and type(managers[0]) is FullAttentionManager:
        return SingleGroupRunningAllocator(coordinator, empty)
    return MultiGroupRunningAllocator(coordinator, empty)
