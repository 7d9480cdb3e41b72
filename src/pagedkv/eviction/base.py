"""Eviction layer: the free-block set of a pool whose cached blocks follow a pluggable policy.

A policy object *is* the pool's free-block set, the role `FreeKVCacheBlockQueue` plays for plain
LRU: the pool pops blocks for reuse, removes hit blocks, appends freed cached blocks, prepends
freed unhashed ones, and calls a few hooks (blocks were cached, a held block was hit, a block
lost its cache entry). Knows nothing of hash maps' contents or of request lifecycles.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, ClassVar

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.errors import InvalidArgumentError, InvariantViolation
from pagedkv.free_queue import FreeKVCacheBlockQueue

if TYPE_CHECKING:
    from pagedkv.eviction.lookahead import WaitingLookahead
    from pagedkv.eviction.retention_levels import RetentionLevels
    from pagedkv.request import Request


def ghost_key(block: KVCacheBlock) -> Hashable:
    """A cache key that outlives the block (for ghost lists): the hash in group 0, else the
    hash with its group. (Callers inline the group-0 case on hot paths.)"""
    block_hash = block.block_hash
    group_id = block.hash_group_id
    return block_hash if group_id == 0 else (block_hash, group_id)


class EvictionPolicy:
    """Free blocks: unhashed ones in a reuse-first queue, cached ones in the policy's order.

    Invariants (`check_invariants`):
    - a free block is in exactly one place: the unhashed queue iff it has no hash; otherwise the
      policy's structure, or a retention level (retention on, priority not the default);
    - `num_free_blocks` counts them all, `num_policy_blocks` those in the policy's structure;
    - unhashed blocks are always reused before any cached block; with retention on, cached
      blocks go in this order: lower priorities, the policy's order (default priority), higher
      priorities; held blocks are never handed out.

    Subclasses implement `_insert_cached` (a cached block became free), `_unlink` (take a free
    cached block out, no accounting), `_pop_victim` (choose and unlink the next victim),
    `_iter_cached` (their free blocks, next victim first), and may override `note_cached`,
    `note_hit`, `_forget` and `_check`.
    """

    name: ClassVar[str] = ""
    uses_requests: ClassVar[bool] = False
    """The policy hears of arrivals and frees (`note_waiting`, `note_freeing`)."""

    def __init__(
        self, blocks: Sequence[KVCacheBlock], retention: RetentionLevels | None = None
    ) -> None:
        self.blocks = blocks  # the pool's blocks, by id (read only)
        self.num_blocks = len(blocks)
        self._unhashed = FreeKVCacheBlockQueue(blocks)
        self.num_free_blocks = len(blocks)
        self.num_policy_blocks = 0
        self.retention = retention
        self.lookahead: WaitingLookahead | None = None
        # Retention or the look-ahead is on: blocks may live outside the policy's order.
        self._guarded = retention is not None
        # The pool's hash maps (read only), for policies that tell a block's duplicates apart.
        self.hash_maps: Sequence[Mapping[BlockHash, KVCacheBlock]] = ()

    def attach(self, hash_maps: Sequence[Mapping[BlockHash, KVCacheBlock]]) -> None:
        """Give the policy read access to the pool's hash maps (called once by the pool)."""
        self.hash_maps = hash_maps

    def enable_lookahead(self, lookahead: WaitingLookahead) -> None:
        """Hold back free blocks that waiting requests will hit (called once, at construction)."""
        self.lookahead = lookahead
        self._guarded = True

    # ------------------------------------------------------------------ request signals

    def note_waiting(self, request: Request) -> None:
        """`request` entered the waiting queue (arrival, or back after a preemption)."""
        lookahead = self.lookahead
        if lookahead is not None and request.request_id not in lookahead.registered:
            block_hashes = request.block_hashes
            # Deepest first, so the protected queue gives up a prefix's tail before its head.
            for block_hash in reversed(lookahead.add_hashes(request.request_id, block_hashes)):
                for hash_map in self.hash_maps:
                    block = hash_map.get(block_hash)
                    if (
                        block is not None
                        and block.ref_cnt == 0
                        and not lookahead.is_protected(block)
                    ):
                        self._take_out(block)
                        lookahead.protect(block)
        if self.uses_requests:
            self._note_arrival(request)

    def note_not_waiting(self, request: Request) -> None:
        """`request` left the waiting queue (scheduled, aborted, finished): drop its hashes."""
        lookahead = self.lookahead
        if lookahead is None or request.request_id not in lookahead.registered:
            return
        released = lookahead.drop_hashes(request.request_id, request.block_hashes)
        for block_hash in reversed(released):  # deepest first, as freed blocks go back
            for hash_map in self.hash_maps:
                block = hash_map.get(block_hash)
                if block is not None and lookahead.is_protected(block):
                    lookahead.unprotect(block)
                    self._put_back(block)

    def note_freeing(self, request: Request) -> None:
        """`request`'s blocks are about to be freed (`end_free` follows the free)."""

    def end_free(self) -> None:
        """The free announced by `note_freeing` is done."""

    def _note_arrival(self, request: Request) -> None:
        """A request arrived (policies with `uses_requests`)."""

    def _take_out(self, block: KVCacheBlock) -> None:
        """Unlink a free cached block from wherever it is (parked or the policy's order)."""
        retention = self.retention
        if retention is not None and retention.is_parked(block):
            retention.unpark(block)
        else:
            self._unlink(block)
            self.num_policy_blocks -= 1

    def _put_back(self, block: KVCacheBlock) -> None:
        """A free cached block returns to its retention level or the policy's order."""
        retention = self.retention
        if retention is not None and retention.park(block):
            return
        self._insert_cached(block)
        self.num_policy_blocks += 1

    # ------------------------------------------------------------------ free-queue interface

    def popleft(self) -> KVCacheBlock:
        """Take the next block to reuse."""
        return self.popleft_n(1)[0]

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks for reuse: unhashed ones first, then the policy's victims.

        Victims keep their hash; the pool drops their cache entries.
        """
        unhashed = self._unhashed
        if num_blocks <= unhashed.num_free_blocks:
            # Hot path: enough never-cached (or uncached) blocks; the policy is not consulted.
            blocks = unhashed.popleft_n(num_blocks)
            self.num_free_blocks -= num_blocks
            return blocks
        if num_blocks > self.num_free_blocks:
            raise InvalidArgumentError(
                f"cannot pop {num_blocks} blocks: only {self.num_free_blocks} are free"
            )
        blocks = unhashed.popleft_n(unhashed.num_free_blocks)
        num_victims = num_blocks - len(blocks)
        if not self._guarded:
            self.num_policy_blocks -= num_victims
            self._pop_victims(num_victims, blocks)
        else:
            pop = self._pop_guarded
            for _ in range(num_victims):
                blocks.append(pop())
        self.num_free_blocks -= num_blocks
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """A free block is hit (or taken): unlink it and count the access."""
        if block.block_hash is None:
            self._unhashed.remove(block)
        else:
            retention = self.retention
            lookahead = self.lookahead
            if lookahead is not None and lookahead.is_protected(block):
                lookahead.unprotect(block)
                if retention is not None:
                    retention.refresh(block)
            elif retention is not None and retention.is_parked(block):
                retention.unpark(block)
                retention.refresh(block)
            else:
                self._unlink(block)
                self.num_policy_blocks -= 1
            self.note_hit(block)
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """A cached block became free."""
        self.append_n((block,))

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Cached blocks became free (in the order given: a request's blocks, last first)."""
        if not self._guarded:
            num_blocks = self._insert_many(blocks)
            self.num_policy_blocks += num_blocks
            self.num_free_blocks += num_blocks
            return
        insert = self._insert_cached
        retention = self.retention
        lookahead = self.lookahead
        num_blocks = num_elsewhere = 0
        for block in blocks:
            num_blocks += 1
            if (
                lookahead is not None
                and lookahead.is_wanted(block)
                and self.hash_maps[block.hash_group_id].get(block.block_hash) is block  # type: ignore[arg-type]
            ):
                lookahead.protect(block)
                num_elsewhere += 1
            elif retention is not None and retention.park(block):
                num_elsewhere += 1
            else:
                insert(block)
        self.num_policy_blocks += num_blocks - num_elsewhere
        self.num_free_blocks += num_blocks

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Unhashed blocks became free: reused first, the first given first."""
        unhashed = self._unhashed
        before = unhashed.num_free_blocks
        unhashed.prepend_n(blocks)
        self.num_free_blocks += unhashed.num_free_blocks - before

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Free blocks, next to reuse first (do not mutate the set while iterating).

        Exact for the unhashed blocks; the cached part follows the policy's current order
        (`_iter_cached` says where an adaptive policy may deviate).
        """
        yield from self._unhashed
        retention = self.retention
        if retention is not None:
            yield from retention.iter_parked(low=True)
        yield from self._iter_cached()
        if retention is not None:
            yield from retention.iter_parked(low=False)
        if self.lookahead is not None:
            yield from self.lookahead

    def __len__(self) -> int:
        return self.num_free_blocks

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self)

    # ------------------------------------------------------------------ hooks from the pool

    def on_cached(
        self,
        request: Request | None,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped: Sequence[KVCacheBlock],
    ) -> None:
        """Blocks `[start, end)` of a table were just cached (held; `skipped` were not).

        `request` is None for a prompt replayed by its block keys alone (no hints to apply).
        """
        skipped_ids = {id(block) for block in skipped} if skipped else None
        self._note_cached_range(blocks, start, end, block_size, skipped_ids)
        if self.retention is not None and request is not None and request.retention is not None:
            self.retention.apply_hints(
                request, blocks, start, end, block_size, skipped_ids, is_new=True
            )

    def take_hits(self, blocks: Sequence[KVCacheBlock], null_block: KVCacheBlock) -> None:
        """Prefix hits are adopted: free ones leave the free set, every one counts an access,
        and each gets the pool's new reference (`ref_cnt += 1`) in the same pass. The null
        block is skipped.

        # Hot path: the pool's reference counting is done here, in the one loop over the hits,
        # on the pool's behalf (`BlockPool.touch`), instead of in a second loop there.
        """
        remove = self.remove
        if self.retention is None and type(self).note_hit is EvictionPolicy.note_hit:
            # Hot path: a hit on a held block changes nothing of the policy's: no call for it.
            for block in blocks:
                if block is null_block:
                    continue
                if block.ref_cnt == 0:
                    remove(block)
                block.ref_cnt += 1
            return
        on_hit_held = self.on_hit_held
        for block in blocks:
            if block is null_block:
                continue
            if block.ref_cnt == 0:
                remove(block)
            else:
                on_hit_held(block)
            block.ref_cnt += 1

    def on_hit_held(self, block: KVCacheBlock) -> None:
        """A block already held by a request is hit by another one."""
        self.note_hit(block)
        if self.retention is not None:
            self.retention.refresh(block)

    def on_uncached(self, block: KVCacheBlock) -> None:
        """`block` is about to lose its cache entry outside reuse (`evict_blocks`)."""
        retention = self.retention
        lookahead = self.lookahead
        if block.ref_cnt == 0:
            if lookahead is not None and lookahead.is_protected(block):
                lookahead.unprotect(block)
            elif retention is not None and retention.is_parked(block):
                retention.unpark(block)
            else:
                self._unlink(block)
                self.num_policy_blocks -= 1
            # Unhashed now: it must be reused before any cached block.
            self._unhashed.prepend_n((block,))
        self._forget(block)
        if retention is not None:
            retention.forget(block)

    def reset(self) -> None:
        """Every block lost its cache entry: all free blocks become unhashed, order kept."""
        order = list(self)
        self._clear()
        if self.retention is not None:
            self.retention.clear()
        if self.lookahead is not None:
            self.lookahead.clear_protected()
        self._unhashed = FreeKVCacheBlockQueue(order)
        self.num_policy_blocks = 0

    # ------------------------------------------------------------------ victims

    def _pop_policy_block(self) -> KVCacheBlock:
        self.num_policy_blocks -= 1
        return self._pop_victim()

    def _pop_guarded(self) -> KVCacheBlock:
        """The next victim with retention or the look-ahead on: low priorities, the policy's
        blocks, high priorities, then the blocks waiting requests will hit."""
        retention = self.retention
        block = None
        if retention is not None:
            retention.expire(self._adopt)
            block = retention.pop_parked(low=True)
        if block is None:
            if self.num_policy_blocks:
                return self._pop_policy_block()
            if retention is not None:
                block = retention.pop_parked(low=False)
            if block is None and self.lookahead is not None:
                block = self.lookahead.pop()
                if block is not None and retention is not None:
                    retention.forget(block)
            if block is None:
                raise InvariantViolation("free-block count says a cached block is free; none is")
        # A parked or protected victim never passed through the policy's order: drop its state.
        self._forget(block)
        return block

    def _adopt(self, block: KVCacheBlock) -> None:
        """Take a free block whose retention lapsed into the policy's order (as if just freed)."""
        self._insert_cached(block)
        self.num_policy_blocks += 1

    # ------------------------------------------------------------------ for subclasses

    def note_cached(self, block: KVCacheBlock, parent: KVCacheBlock | None, end_token: int) -> None:
        """`block` (held) entered the cache after `parent`, holding tokens up to `end_token`."""

    def note_hit(self, block: KVCacheBlock) -> None:
        """`block` was hit (it may be free or held)."""

    def _forget(self, block: KVCacheBlock) -> None:
        """`block` leaves the cache outside `_pop_victim` (drop per-block state)."""

    def _note_cached_range(
        self,
        blocks: Sequence[KVCacheBlock],
        start: int,
        end: int,
        block_size: int,
        skipped_ids: set[int] | None,
    ) -> None:
        """`note_cached` for blocks `[start, end)` of a table (override to batch)."""
        note = self.note_cached
        for index in range(start, end):
            block = blocks[index]
            if skipped_ids is not None and id(block) in skipped_ids:
                continue
            note(block, blocks[index - 1] if index else None, (index + 1) * block_size)

    def _insert_many(self, blocks: Iterable[KVCacheBlock]) -> int:
        """`_insert_cached` for each block, in order; return how many (override to batch)."""
        insert = self._insert_cached
        num_blocks = 0
        for block in blocks:
            insert(block)
            num_blocks += 1
        return num_blocks

    def _pop_victims(self, num_victims: int, out: list[KVCacheBlock]) -> None:
        """Append `num_victims` victims to `out`, in order (override to batch)."""
        pop = self._pop_victim
        for _ in range(num_victims):
            out.append(pop())

    def _insert_cached(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def _unlink(self, block: KVCacheBlock) -> None:
        raise NotImplementedError

    def _pop_victim(self) -> KVCacheBlock:
        raise NotImplementedError

    def _iter_cached(self) -> Iterator[KVCacheBlock]:
        raise NotImplementedError

    def _clear(self) -> None:
        raise NotImplementedError

    def _check(self) -> None:
        """Policy-specific invariants (called by `check_invariants`)."""

    def _check_two_queues(
        self,
        queues: tuple[FreeKVCacheBlockQueue, FreeKVCacheBlockQueue],
        queue_of: Sequence[int],
        counts: tuple[int, int],
        names: str,
    ) -> None:
        """For two-queue policies (arc's T1/T2, s3fifo's S/M): both queues are sound, every
        block in queue i has `queue_of[block_id] == i`, and the cached blocks recorded in each
        queue number `counts`."""
        for code, queue in enumerate(queues):
            queue.check_invariants()
            for block in queue:
                if queue_of[block.block_id] != code:
                    raise InvariantViolation(
                        f"{self.name}: block {block.block_id} in the wrong queue"
                    )
        members = [0, 0]
        for block in self.blocks:
            if block.block_hash is not None:
                members[queue_of[block.block_id]] += 1
        if members != list(counts):
            raise InvariantViolation(
                f"{self.name}: {members} cached blocks in {names}, counted {list(counts)}"
            )

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Check the unhashed queue, the counters and the policy's own structure."""
        self._unhashed.check_invariants()
        for block in self._unhashed:
            if block.block_hash is not None:
                raise InvariantViolation(f"cached block {block.block_id} in the unhashed queue")
        policy_blocks = list(self._iter_cached())
        for block in policy_blocks:
            if block.block_hash is None or block.ref_cnt != 0:
                raise InvariantViolation(
                    f"block {block.block_id} in the {self.name} order is unhashed or held"
                )
        if len(policy_blocks) != self.num_policy_blocks:
            raise InvariantViolation(
                f"{self.name}: {len(policy_blocks)} blocks in the order, "
                f"num_policy_blocks={self.num_policy_blocks}"
            )
        num_parked = 0
        if self.retention is not None:
            self.retention.check_invariants()
            num_parked = self.retention.num_parked_blocks
        if self.lookahead is not None:
            self.lookahead.check_invariants()
            num_parked += self.lookahead.num_protected_blocks
        total = self._unhashed.num_free_blocks + self.num_policy_blocks + num_parked
        if total != self.num_free_blocks:
            raise InvariantViolation(
                f"{self.name}: {total} free blocks found, num_free_blocks={self.num_free_blocks}"
            )
        self._check()
