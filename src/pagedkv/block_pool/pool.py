"""Block pool layer: `BlockPool` owns every block, the free blocks (LRU order, or an eviction
policy's), the prefix-cache hash map, the null block, the event queue and the optional
host-memory tier. Knows nothing of requests' lifecycles or attention types.

The hot methods keep the common case inline; the functions at the end are their general twins
(an eviction policy, metrics or a host tier, duplicate hashes, a double free), each with exactly
its hot twin's result (block ids, free order, events).
"""

from __future__ import annotations

import gc
import logging
from _thread import get_ident
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.block_pool.checks import check_pool_args, check_pool_invariants
from pagedkv.block_pool.entries import drop_key, holds_key, insert_key, remove_keys
from pagedkv.block_pool.events import block_stored_event, partial_block_stored_event
from pagedkv.errors import ForeignBlockError, InvalidArgumentError, InvariantViolation
from pagedkv.events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, KVCacheEvent
from pagedkv.eviction import (
    DEFAULT_EVICTION,
    EvictionConfig,
    EvictionPolicy,
    EvictionStats,
    FreeBlockSet,
    HostTier,
    make_free_blocks,
)
from pagedkv.free_queue import FreeKVCacheBlockQueue
from pagedkv.owner_thread import OwnerThread

if TYPE_CHECKING:
    from pagedkv.request import Request

# The name the pool has always logged under (`pagedkv.block_pool`), whatever file holds it.
logger = logging.getLogger("pagedkv.block_pool")


class BlockResidencyObserver(Protocol):
    """Hooks for sampled block-residency metrics (see `pagedkv.metrics.residency`)."""

    def on_block_allocated(self, block: KVCacheBlock) -> None: ...
    def on_block_accessed(self, block: KVCacheBlock) -> None: ...
    def on_block_evicted(self, block: KVCacheBlock) -> None: ...
    def reset(self) -> None: ...


def _make_blocks(num_blocks: int) -> list[KVCacheBlock]:
    """Build the blocks in an exactly sized list (no growth slack: ~8 bytes a block less).

    The cyclic GC is paused meanwhile: a million new container objects would otherwise
    trigger collections that scan them all repeatedly (building a 1M-block pool takes about
    half the time without them). The blocks form no garbage, so nothing is lost.
    """
    # The None placeholders are all replaced below, before the list is returned.
    blocks: list[KVCacheBlock] = [None] * num_blocks  # type: ignore[list-item]
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for block_id in range(num_blocks):
            blocks[block_id] = KVCacheBlock(block_id)
    finally:
        if gc_was_enabled:
            gc.enable()
    return blocks


class BlockPool:
    """All KV-cache blocks of one device, shared by every KV-cache group.

    Invariants (`check_invariants`):
    - `blocks[i].block_id == i`; block 0 is the null block: never free, hashed or counted.
    - A block is in the free queue iff `ref_cnt == 0` and it is not the null block.
    - A block has a `block_hash` iff the hash map of `hash_group_id` lists it under that hash.
    - Free-queue order is eviction order: allocation pops the head; freed unhashed blocks go
      to the head, freed hashed blocks to the tail; a cached free block keeps its hash until it
      is handed out again (lazy eviction). With an eviction policy (`eviction`), the policy
      orders the cached free blocks; unhashed ones are still reused first.
    - Several blocks may share one hash (no de-duplication); lookups return the first cached.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        hash_block_size: int = 16,
        num_kv_cache_groups: int = 1,
        enable_kv_cache_events: bool = False,
        metrics_collector: BlockResidencyObserver | None = None,
        medium: str = MEDIUM_GPU,
        eviction: EvictionConfig | None = None,
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        eviction = DEFAULT_EVICTION if eviction is None else eviction
        check_pool_args(
            num_blocks, hash_block_size, num_kv_cache_groups, num_hash_lookahead_tokens, eviction
        )
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        # Each block hash also covers this many tokens after the block (events report them).
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.num_kv_cache_groups = num_kv_cache_groups
        self.medium = medium
        self.eviction_config = eviction
        self.blocks: list[KVCacheBlock] = _make_blocks(num_blocks)
        self.free_block_queue: FreeBlockSet = make_free_blocks(eviction, self.blocks)
        # Chosen once: None keeps the reference's free queue and every hook off.
        policy = self.free_block_queue
        self.eviction_policy = policy if isinstance(policy, EvictionPolicy) else None
        # Hot path: one dict per group keyed by the raw hash (no key concatenation). The first
        # block cached under a hash lives here; later duplicates wait in `_duplicates`.
        self.hash_to_block: list[dict[BlockHash, KVCacheBlock]] = [
            {} for _ in range(num_kv_cache_groups)
        ]
        self._duplicates: list[dict[BlockHash, dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_kv_cache_groups)
        ]
        # Block id -> the block's further keys (sub-block entries; `entries.py`), same group.
        self.extra_block_hashes: dict[int, list[BlockHash]] = {}
        self.null_block = self.free_block_queue.popleft()
        if self.eviction_policy is not None:
            self.eviction_policy.attach(self.hash_to_block)
        self.host_tier = (
            HostTier(eviction.host_num_blocks)
            if eviction.host_num_blocks and enable_caching
            else None
        )
        # The head of the side chain `free_blocks` builds before splicing it in; never linked.
        self._head_chain = KVCacheBlock(block_id=-1)
        self.enable_kv_cache_events = enable_kv_cache_events
        self.kv_event_queue: list[KVCacheEvent] = []
        self.metrics_collector = metrics_collector
        # Bumped whenever a cache entry disappears: a lookup result taken at the current epoch
        # is still entirely valid, so adopting it needs no per-block re-check.
        self.eviction_epoch = 0
        # The one thread that may change the pool (and the manager built on it; docs/design.md,
        # "Threads"): every method that changes something checks it first.
        self.owner_thread = OwnerThread(
            "this KV cache (a KVCacheManager and its BlockPool)", "release_owner_thread()"
        )

    # ------------------------------------------------------------------ lookups

    def get_cached_block(
        self, block_hash: BlockHash, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """The cached block for `block_hash` in each group, or None unless every group has one."""
        maps = self.hash_to_block
        found = []
        for group_id in kv_cache_group_ids:
            block = maps[group_id].get(block_hash)
            if block is None:
                return None
            found.append(block)
        return found

    # ------------------------------------------------------------------ allocation

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop `num_blocks` blocks from the head of the free queue, evicting their cache entries."""
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("BlockPool.get_new_blocks")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise InvalidArgumentError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} are free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        collector = self.metrics_collector
        if self.enable_caching:
            if collector is None and self.host_tier is None:
                # Hot path: lazy eviction inlined for the common case (no metrics, no host tier,
                # a hash without duplicates); anything else takes the general method.
                hash_maps = self.hash_to_block
                duplicates = self._duplicates
                extra = self.extra_block_hashes
                # Events on: one BlockRemoved per removed key, as in the general method.
                removed = self.kv_event_queue if self.enable_kv_cache_events else None
                medium = self.medium
                num_evicted = 0
                for block in blocks:
                    block_hash = block.block_hash
                    if block_hash is not None:
                        group_id = block.hash_group_id
                        # Only a hash with duplicates (the block may be a duplicate, or a
                        # primary with one to promote) or a block with further keys needs the
                        # general method; any other cached block is its hash's map entry.
                        group_duplicates = duplicates[group_id]
                        if (group_duplicates and block_hash in group_duplicates) or (
                            extra and block.block_id in extra
                        ):
                            self._maybe_evict_cached_block(block)
                        else:
                            if hash_maps[group_id].pop(block_hash, None) is not block:
                                raise InvariantViolation(
                                    f"block {block.block_id} has a hash but no map entry"
                                )
                            block.block_hash = None
                            block.hash_group_id = 0
                            num_evicted += 1
                            if removed is not None:
                                removed.append(BlockRemoved([block_hash], medium, group_id))
                    block.ref_cnt = 1
                self.eviction_epoch += num_evicted
            else:
                events = self.kv_event_queue if self.enable_kv_cache_events else None
                _evict_for_reuse(blocks, self._maybe_evict_cached_block, self.host_tier, events)
        else:
            for block in blocks:
                block.ref_cnt = 1
        if collector is not None:
            for block in blocks:
                collector.on_block_allocated(block)
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add a reference to each block (a prefix hit), taking free ones out of the free queue."""
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("BlockPool.touch")
        if self.eviction_policy is not None:
            policy, collector = self.eviction_policy, self.metrics_collector
            _touch_with_policy(blocks, policy, self.null_block, collector)
            return
        null_block = self.null_block
        remove = self.free_block_queue.remove
        for block in blocks:
            if block is null_block:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1
        collector = self.metrics_collector
        if collector is not None:
            for block in blocks:
                if block is not null_block:
                    collector.on_block_accessed(block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks reaching zero rejoin the free queue.

        Unhashed blocks go to the head in the order given (reused first); hashed blocks go to
        the tail (evicted last). Callers pass a request's blocks in reverse, so a prefix's tail
        is evicted before its head. The null block is skipped. A block already free (a double
        free) raises `InvalidArgumentError` and leaves every block and the queue as they were.
        """
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("BlockPool.free_blocks")
        if not isinstance(ordered_blocks, (list, tuple)):
            ordered_blocks = list(ordered_blocks)  # C-level copy; lets a bad call be undone
        if self.eviction_policy is not None:
            _free_blocks_to_policy(self.free_block_queue, self.null_block, ordered_blocks)
            return
        # No policy: the free set is the reference's plain queue (the annotation narrows the
        # `FreeBlockSet` protocol and costs nothing at run time). The `union-attr` and
        # `arg-type` ignores below: links between the queue's sentinels are never None
        # (FreeKVCacheBlockQueue's typing note), which mypy cannot know.
        queue: FreeKVCacheBlockQueue = self.free_block_queue  # type: ignore[assignment]
        tail = queue.fake_free_list_tail
        chain = self._head_chain
        null_block = self.null_block
        old_last = last = tail.prev_free_block
        head_last = chain
        num_kept = 0
        blocks = iter(ordered_blocks)
        # Hot path: one pass that drops the reference and links the block at once (hashed
        # blocks straight onto the queue's tail, unhashed ones onto a side chain spliced in at
        # the head afterwards), instead of sorting into two lists and linking them in two more
        # passes. The common block (held once) is tested first; the null block (ref_cnt 0,
        # never counted) and shared blocks take the other branches.
        for block in blocks:
            if block.ref_cnt == 1:
                block.ref_cnt = 0
                if block.block_hash is None:
                    block.prev_free_block = head_last
                    head_last.next_free_block = block
                    head_last = block
                else:
                    block.prev_free_block = last
                    last.next_free_block = block  # type: ignore[union-attr]
                    last = block
            elif block.ref_cnt > 1:
                block.ref_cnt -= 1
                num_kept += 1
            elif block is null_block:
                num_kept += 1
            else:
                num_done = len(ordered_blocks) - sum(1 for _ in blocks) - 1
                _undo_free(ordered_blocks[:num_done], old_last, tail, chain, null_block)  # type: ignore[arg-type]
                raise InvalidArgumentError(
                    f"free_blocks: block {block.block_id} is already free (ref_cnt 0); "
                    "were these blocks freed twice?"
                )
        if last is not old_last:
            last.next_free_block = tail  # type: ignore[union-attr]
            tail.prev_free_block = last
        if head_last is not chain:
            head = queue.fake_free_list_head
            first = chain.next_free_block
            old_first = head.next_free_block
            head.next_free_block = first
            first.prev_free_block = head  # type: ignore[union-attr]
            head_last.next_free_block = old_first
            old_first.prev_free_block = head_last  # type: ignore[union-attr]
            chain.next_free_block = None
        queue.num_free_blocks += len(ordered_blocks) - num_kept

    # ------------------------------------------------------------------ caching

    def cache_full_blocks(
        self,
        request: Request | None,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Enter blocks [num_cached_blocks, num_full_blocks) of a request into the cache.

        `block_hashes` are the request's hashes at this group's block size. Null blocks, and
        blocks whose entry in `block_mask` (aligned with the new blocks) is False, are skipped.
        Emits one `BlockStored` covering the newly cached blocks. `request` may be None only
        with events off (a prompt replayed by its keys alone has no token ids).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("BlockPool.cache_full_blocks")
        if len(block_hashes) < num_full_blocks:
            raise InvariantViolation(
                f"request {request.request_id if request else None!r} has {len(block_hashes)} "
                f"block hashes, {num_full_blocks} needed to cache its full blocks"
            )
        if request is None and self.enable_kv_cache_events:
            raise InvariantViolation("a BlockStored event needs the request's token ids")
        hash_map = self.hash_to_block[kv_cache_group_id]
        setdefault = hash_map.setdefault
        null_block = self.null_block
        emit = self.enable_kv_cache_events
        skipped: list[KVCacheBlock] = []
        # Hot path: zip over slices instead of indexing; one dict operation per block.
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        new_block_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        duplicates = self._duplicates[kv_cache_group_id]
        num_tokens = num_cached_blocks * block_size  # the prefix each new block ends
        if block_mask is None:
            # Hot path: dense caching (the common case) steps through no mask.
            for block, block_hash in zip(new_blocks, new_block_hashes, strict=False):
                num_tokens += block_size
                if block is null_block or (
                    block.block_hash is not None and not self._promote(block, num_tokens)
                ):
                    # Null padding is never cached; a block is hashed at most once (unless a
                    # sub-block entry of it is promoted to the full one).
                    skipped.append(block)
                    continue
                block.block_hash = block_hash
                block.hash_group_id = kv_cache_group_id
                block.hash_num_tokens = num_tokens
                if setdefault(block_hash, block) is not block:
                    duplicates.setdefault(block_hash, {})[block.block_id] = block
        else:
            for block, block_hash, kept in zip(
                new_blocks, new_block_hashes, block_mask, strict=False
            ):
                num_tokens += block_size
                if (
                    not kept
                    or block is null_block
                    or (block.block_hash is not None and not self._promote(block, num_tokens))
                ):
                    # As above; a masked block could never serve a hit.
                    skipped.append(block)
                    continue
                block.block_hash = block_hash
                block.hash_group_id = kv_cache_group_id
                block.hash_num_tokens = num_tokens
                if setdefault(block_hash, block) is not block:
                    duplicates.setdefault(block_hash, {})[block.block_id] = block
        if self.eviction_policy is not None:
            self.eviction_policy.on_cached(
                request, blocks, num_cached_blocks, num_full_blocks, block_size, skipped
            )
        if not emit:
            return
        assert request is not None  # refused above when events are on
        policy = self.eviction_policy
        self.kv_event_queue.append(
            block_stored_event(
                request,
                block_hashes,
                new_blocks,
                new_block_hashes,
                skipped,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                self.num_hash_lookahead_tokens,
                self.medium,
                policy.retention if policy is not None else None,
            )
        )

    def _promote(self, block: KVCacheBlock, num_tokens: int) -> bool:
        """A hashed block `cache_full_blocks` meets: if its hash is a sub-block entry (covering
        fewer than the `num_tokens` its full hash will), drop its keys (with events) so the
        full hash can take their place and return True; else leave it and return False."""
        if block.hash_num_tokens >= num_tokens:
            return False
        self._remove_cached_block_hashes(block)
        return True

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> None:
        """Take a held `block` out of the cache under every key (telling an eviction policy
        first); its ref count stays."""
        if block.block_hash is not None and self.eviction_policy is not None:
            self.eviction_policy.on_uncached(block)
        self._drop_keys(block)

    def _drop_keys(self, block: KVCacheBlock) -> None:
        """Remove every key of `block` from its group's map, one `BlockRemoved` each."""
        group_id = block.hash_group_id
        keys = remove_keys(
            self.hash_to_block[group_id],
            self._duplicates[group_id],
            self.extra_block_hashes,
            block,
        )
        if keys:
            self.eviction_epoch += 1
            if self.enable_kv_cache_events:
                for key in keys:
                    self.kv_event_queue.append(BlockRemoved([key], self.medium, group_id))

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop `block`'s prefix-cache entries if it has any; return whether it had."""
        block_hash = block.block_hash
        if block_hash is None:
            return False
        group_id = block.hash_group_id
        if self.metrics_collector is not None:
            self.metrics_collector.on_block_evicted(block)
        if self.extra_block_hashes and block.block_id in self.extra_block_hashes:
            self._drop_keys(block)
            return True
        hash_map = self.hash_to_block[group_id]
        duplicates = self._duplicates[group_id]
        if not duplicates:
            # Hot path: no hash of this group has duplicates, so this block is the entry.
            if hash_map.pop(block_hash, None) is not block:
                raise InvariantViolation(
                    f"block {block.block_id} has a hash but is not in the hash map"
                )
        else:
            drop_key(hash_map, duplicates, block, block_hash)
        block.block_hash = None
        block.hash_group_id = 0
        self.eviction_epoch += 1
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(
                BlockRemoved(block_hashes=[block_hash], medium=self.medium, group_idx=group_id)
            )
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache entries of the given blocks; ref counts and free queue stay."""
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("BlockPool.evict_blocks")
        ids = list(block_ids)
        for block_id in ids:
            if type(block_id) is not int or not 0 <= block_id < self.num_gpu_blocks:
                raise InvalidArgumentError(
                    f"evict_blocks: block id {block_id!r} is not in [0, {self.num_gpu_blocks})"
                )
        policy = self.eviction_policy
        for block_id in ids:
            block = self.blocks[block_id]
            if policy is not None and block.block_hash is not None:
                policy.on_uncached(block)
            self._maybe_evict_cached_block(block)

    def drop_cache_entry(self, block: KVCacheBlock, block_hash: BlockHash | None = None) -> bool:
        """Remove `block`'s prefix-cache entries without an event; return whether it had any.

        A raw edit of the hash map (what the reference's `BlockHashToBlockMap.pop` is): the
        block keeps its ref count and free-queue place and can be entered again with
        `add_cache_entry`. With `block_hash`, only that key of the block goes (a block reached
        under several keys keeps the others; its primary hash passes to the next one).
        Eviction proper is `evict_blocks`, which reports it.
        """
        owner = self.owner_thread
        if get_ident() != owner.thread_id:
            owner.check("BlockPool.drop_cache_entry")
        self._check_own_block(block, "drop_cache_entry")
        if block.block_hash is None:
            return False
        group_id = block.hash_group_id
        hash_map, duplicates = self.hash_to_block[group_id], self._duplicates[group_id]
        further = self.extra_block_hashes.get(block.block_id)
        if block_hash is not None and further:
            if block_hash in further:
                further.remove(block_hash)
            elif block_hash == block.block_hash:
                # The next key becomes the primary one; what it covers is not known: 0.
                block.block_hash = further.pop(0)
                block.hash_num_tokens = 0
            else:
                return False
            if not further:
                del self.extra_block_hashes[block.block_id]
            drop_key(hash_map, duplicates, block, block_hash)
            self.eviction_epoch += 1
            return True
        if block_hash is not None and block_hash != block.block_hash:
            return False
        if self.eviction_policy is not None:
            self.eviction_policy.on_uncached(block)
        remove_keys(hash_map, duplicates, self.extra_block_hashes, block)
        self.eviction_epoch += 1
        return True

    def add_cache_entry(
        self, block: KVCacheBlock, block_hash: BlockHash, kv_cache_group_id: int
    ) -> None:
        """Enter an unhashed block under `block_hash` in a group, without an event.

        The inverse of `drop_cache_entry` (a block already under this hash and group is left as
        it is). With an eviction policy, which tracks what it caches, only `cache_full_blocks`
        enters blocks.
        """
        owner = self.owner_thread
        if get_ident() != owner.thread_id:
            owner.check("BlockPool.add_cache_entry")
        self._check_own_block(block, "add_cache_entry")
        if block is self.null_block:
            raise InvalidArgumentError("add_cache_entry: the null block is never cached")
        if not isinstance(block_hash, bytes):
            raise InvalidArgumentError(f"add_cache_entry: block hash {block_hash!r} is not bytes")
        if not 0 <= kv_cache_group_id < self.num_kv_cache_groups:
            raise InvalidArgumentError(
                f"add_cache_entry: group {kv_cache_group_id!r} is not in "
                f"[0, {self.num_kv_cache_groups})"
            )
        if block.block_hash is not None:
            if block.block_hash == block_hash and block.hash_group_id == kv_cache_group_id:
                return
            raise InvalidArgumentError(
                f"add_cache_entry: block {block.block_id} is already cached under another hash"
            )
        if self.eviction_policy is not None:
            raise InvalidArgumentError(
                "add_cache_entry: a pool with an eviction policy enters blocks only through "
                "cache_full_blocks"
            )
        block.block_hash = block_hash
        block.hash_group_id = kv_cache_group_id
        block.hash_num_tokens = 0  # a raw entry: the prefix it covers is not known
        if self.hash_to_block[kv_cache_group_id].setdefault(block_hash, block) is not block:
            self._duplicates[kv_cache_group_id].setdefault(block_hash, {})[block.block_id] = block

    def cache_partial_block(
        self,
        request: Request,
        block: KVCacheBlock,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
        parent: KVCacheBlock | None = None,
    ) -> BlockHash | None:
        """Make `block` reachable from the prefix boundary at `num_tokens` (a sub-block, or
        "partial", entry of vLLM 0.33): its key is the request's hash at that boundary.

        `num_tokens` is a positive multiple of `hash_block_size` within the request's hashes.
        The key becomes the block's primary hash if it has none (covering `num_tokens`), else a
        further key; a primary hash covering fewer tokens is dropped first (with its keys), and
        so is every key with `replace_existing_hashes` (the block's contents were replaced).
        One `BlockStored` for the hash block ending at `num_tokens`, unless the block already
        had this key. `parent`: the block before it in the request's table, for an eviction
        policy that orders a prefix's blocks. Returns the key, or None for the null block.
        """
        owner = self.owner_thread
        if get_ident() != owner.thread_id:
            owner.check("BlockPool.cache_partial_block")
        if block is self.null_block:
            return None
        hash_block_size = self.hash_block_size
        num_hash_blocks = num_tokens // hash_block_size
        if (
            num_tokens <= 0
            or num_tokens % hash_block_size
            or num_hash_blocks > len(request.block_hashes)
            or block_size % hash_block_size
        ):
            raise InvalidArgumentError(
                f"cache_partial_block: num_tokens {num_tokens} must be a positive multiple of "
                f"hash_block_size {hash_block_size} within the request's "
                f"{len(request.block_hashes)} hashes (block_size {block_size})"
            )
        block_hash = request.block_hashes[num_hash_blocks - 1]
        group_id = kv_cache_group_id
        if replace_existing_hashes:
            self._remove_cached_block_hashes(block)
        elif block.block_hash is not None and block.hash_group_id != group_id:
            raise InvalidArgumentError(
                f"cache_partial_block: block {block.block_id} is cached in group "
                f"{block.hash_group_id}, not {group_id}"
            )
        elif (
            block.block_hash is not None
            and block.hash_num_tokens < num_tokens
            and not holds_key(self.extra_block_hashes, block, block_hash)
        ):
            self._remove_cached_block_hashes(block)  # the block now holds a longer prefix
        was_cached = block.block_hash is not None
        added = insert_key(
            self.hash_to_block[group_id],
            self._duplicates[group_id],
            self.extra_block_hashes,
            block,
            block_hash,
            group_id,
            num_tokens,
        )
        if not was_cached and self.eviction_policy is not None:
            self.eviction_policy.note_cached(block, parent, num_tokens)
        if added and self.enable_kv_cache_events:
            self.kv_event_queue.append(
                partial_block_stored_event(
                    request,
                    block,
                    num_hash_blocks,
                    hash_block_size,
                    group_id,
                    self.num_hash_lookahead_tokens,
                    self.medium,
                )
            )
        return block_hash

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-point every key of `src_block` to the unhashed `dst_block`, no events: the
        request holding `src_block` goes on writing into it, and the cache keeps a private copy
        (a copy-on-write destination) under the same keys."""
        if dst_block.block_hash is not None or dst_block.block_id in self.extra_block_hashes:
            raise InvariantViolation(
                f"move_block_hashes: destination block {dst_block.block_id} is already cached"
            )
        group_id = src_block.hash_group_id
        num_tokens = src_block.hash_num_tokens
        hash_map, duplicates = self.hash_to_block[group_id], self._duplicates[group_id]
        policy = self.eviction_policy
        if policy is not None and src_block.block_hash is not None:
            policy.on_uncached(src_block)
        keys = remove_keys(hash_map, duplicates, self.extra_block_hashes, src_block)
        for key in keys:
            insert_key(
                hash_map, duplicates, self.extra_block_hashes, dst_block, key, group_id, num_tokens
            )
        if policy is not None and keys:
            policy.note_cached(dst_block, None, num_tokens)

    def get_cached_blocks(
        self, block_hash: BlockHash, kv_cache_group_id: int
    ) -> list[KVCacheBlock]:
        """Every block one group caches under `block_hash`, first-cached first."""
        first = self.hash_to_block[kv_cache_group_id].get(block_hash)
        if first is None:
            return []
        others = self._duplicates[kv_cache_group_id].get(block_hash)
        return [first, *others.values()] if others else [first]

    def _check_own_block(self, block: KVCacheBlock, method: str) -> None:
        block_id = getattr(block, "block_id", None)
        if (
            type(block_id) is not int
            or not 0 <= block_id < self.num_gpu_blocks
            or self.blocks[block_id] is not block
        ):
            raise ForeignBlockError(f"{method}: {block!r} is not a block of this pool")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held."""
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("BlockPool.reset_prefix_cache")
        num_used = self.num_gpu_blocks - 1 - self.free_block_queue.num_free_blocks
        if num_used > 0:
            logger.warning(
                "Failed to reset the prefix cache: %d blocks are still held by requests", num_used
            )
            return False
        if self.eviction_policy is not None:
            self.eviction_policy.reset()
        if self.host_tier is not None:
            self.host_tier.clear()  # AllBlocksCleared clears every medium for a consumer
        # Cleared in place: the facade and managers keep references to these dicts.
        for hash_map in self.hash_to_block:
            hash_map.clear()
        for duplicates in self._duplicates:
            duplicates.clear()
        self.extra_block_hashes.clear()
        for block in self.blocks:
            block.block_hash = None
            block.hash_group_id = 0
        self.eviction_epoch += 1
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the event queue (an empty list when events are off)."""
        owner = self.owner_thread
        if get_ident() != owner.thread_id:  # Hot path: the owner pays one C call
            owner.check("BlockPool.take_events")
        if not self.kv_event_queue:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # ------------------------------------------------------------------ reads

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks in use (cached-but-free blocks count as free)."""
        usable = self.num_gpu_blocks - 1
        return 1.0 - self.free_block_queue.num_free_blocks / usable

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head, the next to reuse, first)."""
        return [block.block_id for block in self.free_block_queue]

    def cached_hashes(self, kv_cache_group_id: int = 0) -> dict[BlockHash, list[int]]:
        """Hash → cached block ids (first-cached first) for one group."""
        out = {h: [b.block_id] for h, b in self.hash_to_block[kv_cache_group_id].items()}
        for block_hash, others in self._duplicates[kv_cache_group_id].items():
            out[block_hash].extend(others)
        return out

    def get_eviction_stats(self) -> EvictionStats:
        """The eviction policy's name and the retention and host-tier counters."""
        policy = self.eviction_policy
        retention = policy.retention if policy is not None else None
        lookahead = policy.lookahead if policy is not None else None
        host = self.host_tier
        return EvictionStats(
            self.eviction_config.policy,
            retention.num_retained_blocks if retention is not None else 0,
            retention.num_demoted_blocks if retention is not None else 0,
            retention.num_lapsed_blocks if retention is not None else 0,
            len(host) if host is not None else 0,
            host.num_demoted_blocks if host is not None else 0,
            host.num_evicted_blocks if host is not None else 0,
            host.num_promoted_blocks if host is not None else 0,
            lookahead.num_protected_blocks if lookahead is not None else 0,
            lookahead.num_protections if lookahead is not None else 0,
        )

    def num_cached_blocks(self) -> int:
        """Blocks currently in the prefix cache, all groups (a block under several keys once)."""
        num_entries = sum(len(m) for m in self.hash_to_block) + sum(
            len(d) for dups in self._duplicates for d in dups.values()
        )
        return num_entries - sum(len(keys) for keys in self.extra_block_hashes.values())

    def check_invariants(self) -> None:
        """Verify the invariants of the class docstring; raise `InvariantViolation` on the
        first broken one."""
        check_pool_invariants(
            self.blocks,
            self.null_block,
            self.free_block_queue,
            self.host_tier,
            self.hash_to_block,
            self._duplicates,
            self.extra_block_hashes,
            self.enable_caching,
        )


# ---------------------------------------------------------------------- the general twins


def _free_blocks_to_policy(
    policy: FreeBlockSet, null_block: KVCacheBlock, ordered_blocks: Sequence[KVCacheBlock]
) -> None:
    """`BlockPool.free_blocks` with an eviction policy: the blocks reaching zero go to the policy
    in two runs (unhashed ones to be reused first, hashed ones in the order given). A double
    free raises `InvalidArgumentError` with every reference given back."""
    to_head: list[KVCacheBlock] = []
    to_tail: list[KVCacheBlock] = []
    for index, block in enumerate(ordered_blocks):
        if block is null_block:
            continue
        ref_cnt = block.ref_cnt - 1
        if ref_cnt > 0:
            block.ref_cnt = ref_cnt
        elif ref_cnt == 0:
            block.ref_cnt = 0
            if block.block_hash is None:
                to_head.append(block)
            else:
                to_tail.append(block)
        else:
            for freed in ordered_blocks[:index]:
                if freed is not null_block:
                    freed.ref_cnt += 1
            raise InvalidArgumentError(
                f"free_blocks: block {block.block_id} is already free (ref_cnt 0); "
                "were these blocks freed twice?"
            )
    if to_head:
        policy.prepend_n(to_head)
    if to_tail:
        policy.append_n(to_tail)


def _undo_free(
    done: Sequence[KVCacheBlock],
    old_last: KVCacheBlock,
    tail: KVCacheBlock,
    head_chain: KVCacheBlock,
    null_block: KVCacheBlock,
) -> None:
    """Give back the references the plain queue's `free_blocks` dropped from `done` and unlink
    what it linked: the blocks after `old_last` (the tail before the call) and the side chain
    hanging from `head_chain`, which was not spliced in yet."""
    old_last.next_free_block = tail
    tail.prev_free_block = old_last
    head_chain.next_free_block = None
    for block in done:
        if block is null_block:
            continue
        block.ref_cnt += 1
        if block.ref_cnt == 1:  # it had reached zero and was linked
            block.prev_free_block = block.next_free_block = None


def _evict_for_reuse(
    blocks: Sequence[KVCacheBlock],
    evict: Callable[[KVCacheBlock], bool],
    host: HostTier | None,
    events: list[KVCacheEvent] | None,
) -> None:
    """`BlockPool.get_new_blocks` with metrics on or a host tier: drop the cache entries of the
    blocks popped for reuse through `evict` (the pool's general eviction), demote them to the
    host tier, and take a reference on each."""
    for block in blocks:
        block_hash = block.block_hash
        if block_hash is not None:
            group_id = block.hash_group_id
            evict(block)
            if host is not None:
                host.demote(block_hash, group_id, events)
        block.ref_cnt = 1


def _touch_with_policy(
    blocks: Sequence[KVCacheBlock],
    policy: EvictionPolicy,
    null_block: KVCacheBlock,
    collector: BlockResidencyObserver | None,
) -> None:
    """`BlockPool.touch` with an eviction policy, which also hears of hits on blocks other
    requests hold (and adds the reference to each block)."""
    policy.take_hits(blocks, null_block)
    if collector is not None:
        for block in blocks:
            if block is not null_block:
                collector.on_block_accessed(block)
