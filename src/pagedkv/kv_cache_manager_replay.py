"""Facade layer, replay: `KVCacheManager.try_prefill_and_free`, a whole prompt by its keys alone.

For trace replay, where only the block keys matter: the same blocks, hits and free order as a
lookup, an allocation and a free of a request, without building the request. Holds no state of
its own; checks its arguments before the manager changes anything.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.admission import check_count
from pagedkv.block import BlockHash
from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.managers import FullAttentionManager


class KVCacheManagerReplay:
    """The replay entry point of a `KVCacheManager` (the attributes below are the manager's)."""

    max_model_len: int
    enable_caching: bool
    enable_kv_cache_events: bool
    _fast_manager: FullAttentionManager | None

    def try_prefill_and_free(
        self, block_hashes: Sequence[BlockHash], num_tokens: int
    ) -> int | None:
        """Run a prompt through as a request that arrives alone, computes it and finishes.

        Block for block the same as `get_computed_blocks`, `allocate_slots(request, num_tokens
        - hit, hit, hit_blocks, has_scheduled_reqs=False)` and `free` of a request with these
        block hashes, without building the request: for trace replay, where only the keys
        matter. Keys are only compared (a hasher's digests, or any hashable keys equal iff the
        prefixes are equal). Needs one full-attention group and KV events off (a BlockStored
        event carries token ids). Changes nothing unless the whole prompt fits.

        Returns:
            The prompt's prefix-hit tokens, or None if it does not fit.
        """
        manager = self._fast_manager
        if manager is None or self.enable_kv_cache_events:
            raise ConfigError(
                "try_prefill_and_free needs one full-attention KV-cache group and KV events "
                "off; use get_computed_blocks, allocate_slots and free"
            )
        check_count("num_tokens", num_tokens, 1)
        if num_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"a {num_tokens}-token prompt exceeds max_model_len {self.max_model_len}"
            )
        num_full_blocks = num_tokens // manager.block_size
        if self.enable_caching and len(block_hashes) < num_full_blocks:
            raise InvalidArgumentError(
                f"a {num_tokens}-token prompt has {num_full_blocks} full blocks but "
                f"{len(block_hashes)} block hashes"
            )
        return manager.prefill_and_free(block_hashes, num_tokens)
