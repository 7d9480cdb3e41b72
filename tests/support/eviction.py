"""Shared builders for the eviction tests: a manager per policy, a test oracle for belady,
and the reference's `test_prefill` steps as a reusable scenario."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from pagedkv import BlockRemoved, BlockStored, KVCacheManager
from pagedkv.block import BlockHash
from pagedkv.eviction import EVICTION_POLICY_NAMES, NEVER, EvictionConfig
from tests.support.builders import make_manager

ALL_POLICIES = EVICTION_POLICY_NAMES


class HashOrderOracle:
    """A stand-in future for belady in tests that only need *a* consistent order: a hash's next
    use is read from its first bytes (or from `next_uses`, when given)."""

    def __init__(self, next_uses: dict[bytes, int] | None = None) -> None:
        self.next_uses = next_uses

    def next_use(self, block_hash: BlockHash) -> int:
        if self.next_uses is not None:
            return self.next_uses.get(block_hash, NEVER)
        return int.from_bytes(block_hash[:3], "big")


def eviction_config(policy: str, **kwargs) -> EvictionConfig:
    if policy == "belady":
        kwargs.setdefault("oracle", HashOrderOracle())
    return EvictionConfig(policy=policy, **kwargs)


def policy_manager(
    policy: str, num_blocks: int, block_size: int, max_model_len: int = 8192, **kwargs
) -> KVCacheManager:
    eviction = kwargs.pop("eviction", None) or eviction_config(policy)
    return make_manager(
        num_blocks, block_size, max_model_len=max_model_len, eviction=eviction, **kwargs
    )


class EventMirror:
    """A consumer's view of the cache built from events alone (multiset of hashes per medium)."""

    def __init__(self) -> None:
        self.by_medium: dict[str | None, Counter] = {}

    def apply(self, events: Sequence) -> None:
        for event in events:
            counter = (
                self.by_medium.setdefault(event.medium, Counter())
                if hasattr(event, "medium")
                else None
            )
            if type(event) is BlockStored:
                assert counter is not None
                counter.update(event.block_hashes)
            elif type(event) is BlockRemoved:
                assert counter is not None
                counter.subtract(event.block_hashes)
                assert min(counter.values(), default=0) >= 0, "removed a hash never stored"
            else:
                self.by_medium.clear()

    def hashes(self, medium: str) -> Counter:
        return +self.by_medium.get(medium, Counter())


def pool_hash_counts(manager: KVCacheManager) -> Counter:
    """Every cached block's hash, counted (duplicates included)."""
    return Counter(
        block.block_hash for block in manager.block_pool.blocks if block.block_hash is not None
    )
