"""Facade layer, host-memory tier: how `KVCacheManager` admits a prefix from the host tier.

`KVCacheManagerHostTier` (a base of `KVCacheManager`) counts a request's host hits and records
their load; the allocation itself takes them as external tokens (`allocate_slots`). Holds no
state of its own; without a host tier both methods do nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.admission import check_count
from pagedkv.block_pool import BlockPool
from pagedkv.errors import ConfigError, InvalidArgumentError, RequestStateError
from pagedkv.managers import FullAttentionManager, SingleTypeKVCacheManager
from pagedkv.request import Request


def check_host_tier_layout(
    block_pool: BlockPool, managers: Sequence[SingleTypeKVCacheManager]
) -> None:
    """Raise `ConfigError` unless a pool with a host tier serves one full-attention group."""
    if block_pool.host_tier is not None and (
        len(managers) != 1 or type(managers[0]) is not FullAttentionManager
    ):
        raise ConfigError("the host-memory tier needs one full-attention KV-cache group")


class KVCacheManagerHostTier:
    """The host-tier methods of a `KVCacheManager` (the attributes below are the manager's)."""

    hash_block_size: int
    block_pool: BlockPool
    _requests: dict[str, Request]

    def get_num_host_hit_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens right after the first `num_computed_tokens` that the host-memory tier holds
        (whole blocks; at most `num_tokens - 1` in all, as for device hits). Changes nothing.

        Returns:
            0 without a host tier; else pass the count to `allocate_slots` as
            `num_external_computed_tokens`, then call `load_from_host` once it is allocated.
        """
        host = self.block_pool.host_tier
        if host is None or request.skip_reading_prefix_cache:
            return 0
        check_count("num_computed_tokens", num_computed_tokens)
        block_size = self.hash_block_size
        stop = min((request.num_tokens - 1) // block_size, len(request.block_hashes))
        start = num_computed_tokens // block_size
        if num_computed_tokens % block_size or start > stop:
            raise InvalidArgumentError(
                f"num_computed_tokens={num_computed_tokens} is not a whole number of "
                f"{block_size}-token blocks within request {request.request_id!r}'s prompt"
            )
        return host.count_hits(request.block_hashes, start, stop) * block_size

    def load_from_host(self, request: Request, num_computed_tokens: int, num_tokens: int) -> None:
        """Record the load of tokens `[num_computed_tokens, +num_tokens)` from the host tier
        into the request's blocks (call after `allocate_slots` took them as external tokens):
        the host entries become its most recently used (promotion keeps the host copy)."""
        host = self.block_pool.host_tier
        if host is None or num_tokens == 0:
            return
        block_size = self.hash_block_size
        check_count("num_computed_tokens", num_computed_tokens)
        check_count("num_tokens", num_tokens)
        if (
            num_computed_tokens % block_size
            or num_tokens % block_size
            or (self._requests.get(request.request_id) is not request)
        ):
            raise RequestStateError(
                f"request {request.request_id!r}: load_from_host({num_computed_tokens}, "
                f"{num_tokens}) needs whole blocks of a request holding blocks here"
            )
        start = num_computed_tokens // block_size
        # Entries the allocation itself pushed out were read before their slot was reused.
        host.promote(request.block_hashes[start : start + num_tokens // block_size])
