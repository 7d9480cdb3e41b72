"""Eviction layer: the waiting-queue look-ahead, on top of any policy.

A scheduler registers each waiting request's block hashes once, when the request enters the
queue (`register`), and drops them when it leaves (`unregister`: scheduled, aborted). A free
cached block that a registered request will hit is *protected*: it leaves the policy's order
and is evicted only after every other free block (least recently protected first), since
evicting it is a miss already known. O(1) per registered hash and per freed block.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from pagedkv.block import BlockHash, KVCacheBlock
from pagedkv.errors import InvariantViolation
from pagedkv.free_queue import FreeKVCacheBlockQueue


class WaitingLookahead:
    """Waiting requests' hashes (counted) and the protected free blocks.

    Invariants (`check_invariants`): a block is protected iff it is free, cached, and some
    registered request has its hash; `num_waiting[h]` counts the registered requests holding
    `h` among their registered hashes; `registered[r]` is how many of request r's first hashes
    are counted.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.blocks = blocks
        self.num_waiting: dict[BlockHash, int] = {}
        self.registered: dict[str, int] = {}
        self._protected = FreeKVCacheBlockQueue(())
        self._is_protected = bytearray(len(blocks))
        self.num_protected_blocks = 0
        self.num_protections = 0  # blocks taken out of the policy's order, since construction

    def is_protected(self, block: KVCacheBlock) -> bool:
        return bool(self._is_protected[block.block_id])

    def is_wanted(self, block: KVCacheBlock) -> bool:
        """A waiting request will hit this (cached) block."""
        return block.block_hash in self.num_waiting

    def protect(self, block: KVCacheBlock) -> None:
        """Hold a free cached block back (it is in no other free structure)."""
        self._protected.append(block)
        self._is_protected[block.block_id] = 1
        self.num_protected_blocks += 1
        self.num_protections += 1

    def unprotect(self, block: KVCacheBlock) -> None:
        """Take a protected block out (hit, evicted, or no longer wanted)."""
        self._protected.remove(block)
        self._is_protected[block.block_id] = 0
        self.num_protected_blocks -= 1

    def pop(self) -> KVCacheBlock | None:
        """The least recently protected block, taken out; None if there is none."""
        if not self.num_protected_blocks:
            return None
        block = self._protected.popleft()
        self._is_protected[block.block_id] = 0
        self.num_protected_blocks -= 1
        return block

    def add_hashes(self, request_id: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Count a request's hashes; return those no other waiting request had."""
        num_waiting = self.num_waiting
        first_seen = []
        for block_hash in block_hashes:
            count = num_waiting.get(block_hash)
            if count is None:
                num_waiting[block_hash] = 1
                first_seen.append(block_hash)
            else:
                num_waiting[block_hash] = count + 1
        self.registered[request_id] = len(block_hashes)
        return first_seen

    def drop_hashes(self, request_id: str, block_hashes: Sequence[BlockHash]) -> list[BlockHash]:
        """Uncount a registered request's hashes; return those no waiting request has now."""
        num_registered = self.registered.pop(request_id, None)
        if num_registered is None:
            return []
        num_waiting = self.num_waiting
        released = []
        for block_hash in block_hashes[:num_registered]:
            count = num_waiting[block_hash]
            if count == 1:
                del num_waiting[block_hash]
                released.append(block_hash)
            else:
                num_waiting[block_hash] = count - 1
        return released

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._protected)

    def clear_protected(self) -> list[KVCacheBlock]:
        """Every block lost its cache entry: return the protected blocks, oldest first."""
        order = list(self._protected)
        self._protected = FreeKVCacheBlockQueue(())
        self._is_protected = bytearray(len(self.blocks))
        self.num_protected_blocks = 0
        return order

    def check_invariants(self) -> None:
        self._protected.check_invariants()
        for block in self._protected:
            if not self._is_protected[block.block_id]:
                raise InvariantViolation(f"lookahead: block {block.block_id} unmarked")
            if block.ref_cnt or block.block_hash is None:
                raise InvariantViolation(
                    f"lookahead: protected block {block.block_id} is held or uncached"
                )
            if block.block_hash not in self.num_waiting:
                raise InvariantViolation(
                    f"lookahead: protected block {block.block_id} is wanted by no request"
                )
        if sum(self._is_protected) != self.num_protected_blocks or (
            self._protected.num_free_blocks != self.num_protected_blocks
        ):
            raise InvariantViolation("lookahead: protected count is wrong")
        for count in self.num_waiting.values():
            if count < 1:
                raise InvariantViolation("lookahead: a hash counted for no request")
