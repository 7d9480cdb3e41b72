"""Simulator layer: the future of a replay, for the offline optimum (`belady` eviction).

A request *uses* the block keys of its hittable prefix: the first `(num_tokens - 1) //
block_size` blocks (a lookup leaves one token to compute). One backward pass over the trace
gives, for every use, the index of the next request using the same key; the replay then
advances request by request, and `next_use(key)` answers in O(1).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence

from pagedkv.eviction import NEVER


class ReplayOracle:
    """When each block key is next used, as of the request being replayed.

    Invariant: after `advance(i)`, `next_use(k)` is the smallest index `j > i` of a request
    that uses `k` (NEVER if none); before any `advance`, the first use of `k`.
    """

    def __init__(self, uses: Sequence[Sequence[Hashable]]) -> None:
        """`uses[i]`: the keys request `i` uses (empty for a request that is not served)."""
        self._uses = uses
        next_index: dict[Hashable, int] = {}
        after: list[array] = [array("q")] * len(uses)
        for index in range(len(uses) - 1, -1, -1):
            keys = uses[index]
            if not keys:
                continue
            get = next_index.get
            after[index] = array("q", [get(key, NEVER) for key in keys])
            for key in keys:
                next_index[key] = index
        self._after = after
        self._next = next_index  # now each key's first use
        self.current_index = -1

    def advance(self, index: int) -> None:
        """Request `index` is about to be served (call once per request, in order)."""
        next_uses = self._next
        for key, next_use in zip(self._uses[index], self._after[index], strict=True):
            next_uses[key] = next_use
        self.current_index = index

    def next_use(self, block_hash: Hashable) -> int:
        return self._next.get(block_hash, NEVER)


def hittable_keys(block_keys: Sequence[Hashable], num_tokens: int, block_size: int):
    """The keys a request of `num_tokens` tokens can hit (all but the last token's block)."""
    return block_keys[: (num_tokens - 1) // block_size]
