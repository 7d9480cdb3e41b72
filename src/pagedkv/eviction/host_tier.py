"""Eviction layer: the host-memory tier, a second and larger cache in CPU memory.

Blocks the device pool evicts for reuse are demoted here (a victim cache, as TensorRT-LLM's
host offloading does; vLLM 0.33's CPU offloading and LMCache store on compute instead); a
device miss that the host tier holds is loaded back (promoted) at a transfer cost the caller
charges. Entries are hashes only (the KV bytes are the engine's business), evicted least
recently used first. Events carry `medium="CPU"` in the form vLLM's offloading connector uses
for entries it knows only by hash (no token ids, block size 0).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from pagedkv.block import BlockHash
from pagedkv.errors import ConfigError, InvariantViolation
from pagedkv.events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent


class HostTier:
    """Block hashes held in host memory, least recently used first (one KV-cache group).

    Invariants: at most `num_blocks` entries; every demotion either refreshes an entry or adds
    one (and, past capacity, removes the oldest); the counters only grow until `clear`.
    """

    def __init__(self, num_blocks: int, medium: str = MEDIUM_CPU) -> None:
        if type(num_blocks) is not int or num_blocks < 1:
            raise ConfigError(f"host tier num_blocks={num_blocks!r} must be an int >= 1")
        self.num_blocks = num_blocks
        self.medium = medium
        self._entries: OrderedDict[BlockHash, None] = OrderedDict()
        self.num_demoted_blocks = 0  # stored on demotion (a refresh is not counted)
        self.num_evicted_blocks = 0
        self.num_promoted_blocks = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def demote(
        self, block_hash: BlockHash, group_id: int, events: list[KVCacheEvent] | None
    ) -> None:
        """The device evicted a block with this hash: keep (or refresh) it here."""
        entries = self._entries
        if block_hash in entries:
            entries.move_to_end(block_hash)
            return
        entries[block_hash] = None
        self.num_demoted_blocks += 1
        if events is not None:
            events.append(
                BlockStored([block_hash], None, [], 0, None, self.medium, None, None, group_id)
            )
        if len(entries) > self.num_blocks:
            oldest, _ = entries.popitem(last=False)
            self.num_evicted_blocks += 1
            if events is not None:
                events.append(BlockRemoved([oldest], self.medium, group_id))

    def count_hits(self, block_hashes: Sequence[BlockHash], start: int, stop: int) -> int:
        """How many consecutive hashes from index `start` (below `stop`) are held here."""
        entries = self._entries
        index = start
        while index < stop and block_hashes[index] in entries:
            index += 1
        return index - start

    def promote(self, block_hashes: Sequence[BlockHash]) -> None:
        """These hashes were loaded back to the device: they become the most recently used."""
        entries = self._entries
        for block_hash in block_hashes:
            if block_hash in entries:
                entries.move_to_end(block_hash)
        self.num_promoted_blocks += len(block_hashes)

    def cached_hashes(self) -> list[BlockHash]:
        """Held hashes, least recently used (next to evict) first."""
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()

    def check_invariants(self) -> None:
        if len(self._entries) > self.num_blocks:
            raise InvariantViolation(
                f"host tier holds {len(self._entries)} blocks > capacity {self.num_blocks}"
            )
