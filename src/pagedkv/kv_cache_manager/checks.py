"""Facade layer, checks: a `KVCacheManager`'s constructor arguments and every `allocate_slots`
argument against the current state.

Raises a specific `PagedKVError` naming the bad value before anything changes. Knows the live
request registry and the pool, never allocates.
"""

from __future__ import annotations

from collections.abc import Sequence
from math import gcd, lcm

from pagedkv.block import KVCacheBlock
from pagedkv.block_pool import BlockPool
from pagedkv.errors import (
    ConfigError,
    ForeignBlockError,
    GroupIndexError,
    InvalidArgumentError,
    InvalidTypeError,
    RequestStateError,
)
from pagedkv.kv_cache_blocks import KVCacheBlocks
from pagedkv.managers import FullAttentionManager, MambaManager, SingleTypeKVCacheManager
from pagedkv.request import Request, RequestStatus
from pagedkv.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
    SpecDecodeConfig,
    cdiv,
    shard_across_context_parallel_ranks,
)


def check_count(name: str, value: object, minimum: int = 0) -> None:
    """Raise unless `value` is an int (not bool) >= `minimum`, naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidTypeError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")


def check_manager_config(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    scheduler_block_size: int | None,
    hash_block_size: int | None,
    max_in_flight_tokens: int | None,
    enable_caching: bool,
    watermark: float,
    spec_decode: SpecDecodeConfig,
    dcp_world_size: int,
    pcp_world_size: int,
) -> tuple[KVCacheConfig, int, int]:
    """Check a `KVCacheManager`'s arguments; return the config the managers see (sharded
    groups' blocks scaled by `dcp_world_size`) and the resolved scheduler and hash block sizes.

    Block sizes default to the LCM and the GCD of the groups' (scaled) block sizes.
    """
    if not isinstance(kv_cache_config, KVCacheConfig):
        raise ConfigError(f"kv_cache_config must be a KVCacheConfig, got {kv_cache_config!r}")
    check_count("max_model_len", max_model_len, 1)
    if not isinstance(watermark, (int, float)) or not 0.0 <= watermark < 1.0:
        raise InvalidArgumentError(f"watermark must be in [0, 1), got {watermark!r}")
    check_count("dcp_world_size", dcp_world_size, 1)
    check_count("pcp_world_size", pcp_world_size, 1)
    groups = kv_cache_config.kv_cache_groups
    for group_id, group in enumerate(groups):
        spec = group.kv_cache_spec
        replicated_attention = isinstance(spec, AttentionSpec) and not spec.dcp_sharded
        if pcp_world_size > 1 and not (isinstance(spec, FullAttentionSpec) or replicated_attention):
            raise ConfigError(
                f"group {group_id} is {type(spec).__name__}: prefill context parallelism "
                "supports full attention and replicated draft groups only"
            )
        if (
            dcp_world_size > 1
            and len(groups) > 1
            and not (isinstance(spec, (FullAttentionSpec, MambaSpec)) or not spec.dcp_sharded)
        ):
            raise ConfigError(
                f"group {group_id} is {type(spec).__name__}: decode context parallelism with "
                "hybrid layouts supports full-attention, Mamba and replicated draft groups only"
            )
    kv_cache_config = shard_across_context_parallel_ranks(kv_cache_config, dcp_world_size)
    groups = kv_cache_config.kv_cache_groups
    # A scratch ring's block size (its capacity) is no part of the token lattice.
    lattice = [(i, g.kv_cache_spec.block_size) for i, g in enumerate(groups)
               if g.kv_cache_spec.covers_token_range]  # fmt: skip
    block_sizes = [block_size for _, block_size in lattice]
    if scheduler_block_size is None:
        scheduler_block_size = lcm(*block_sizes) if block_sizes else 1
    if hash_block_size is None:
        hash_block_size = gcd(*block_sizes) if block_sizes else 1
    check_count("scheduler_block_size", scheduler_block_size, 1)
    check_count("hash_block_size", hash_block_size, 1)
    if scheduler_block_size % hash_block_size:
        raise ConfigError(
            f"scheduler_block_size {scheduler_block_size} is not a multiple of "
            f"hash_block_size {hash_block_size}"
        )
    for group_id, block_size in lattice:
        if scheduler_block_size % block_size:
            raise ConfigError(
                f"group {group_id}'s block size {block_size} does not divide "
                f"scheduler_block_size {scheduler_block_size}"
            )
    if max_in_flight_tokens is not None:
        check_count("max_in_flight_tokens", max_in_flight_tokens, 1)
    _check_spec_decode(kv_cache_config, scheduler_block_size, enable_caching, spec_decode)
    _check_retention_interval(kv_cache_config, scheduler_block_size)
    return kv_cache_config, scheduler_block_size, hash_block_size


def check_host_tier_layout(
    block_pool: BlockPool, managers: Sequence[SingleTypeKVCacheManager]
) -> None:
    """Raise `ConfigError` unless a pool with a host tier serves one full-attention group."""
    if block_pool.host_tier is not None and (
        len(managers) != 1 or type(managers[0]) is not FullAttentionManager
    ):
        raise ConfigError("the host-memory tier needs one full-attention KV-cache group")


def _check_spec_decode(
    kv_cache_config: KVCacheConfig,
    scheduler_block_size: int,
    enable_caching: bool,
    spec_decode: SpecDecodeConfig,
) -> None:
    groups = kv_cache_config.kv_cache_groups
    has_eagle_groups = spec_decode.use_eagle or any(g.is_eagle_group for g in groups)
    if (
        enable_caching
        and has_eagle_groups
        and scheduler_block_size < spec_decode.num_prefill_lookahead
    ):
        # A hit drops one scheduler block, which must hold the tokens the drafter prefills again.
        raise ConfigError(
            f"multi-module MTP with prefix caching needs scheduler_block_size "
            f"({scheduler_block_size}) >= num_prefill_lookahead "
            f"({spec_decode.num_prefill_lookahead})"
        )


def _check_retention_interval(kv_cache_config: KVCacheConfig, scheduler_block_size: int) -> None:
    interval = kv_cache_config.prefix_cache_retention_interval
    if interval is None:
        return
    sparse = (SlidingWindowSpec, MambaSpec)
    if not any(isinstance(g.kv_cache_spec, sparse) for g in kv_cache_config.kv_cache_groups):
        if interval == 0:
            return
        raise ConfigError(
            f"prefix_cache_retention_interval={interval} has no effect: the model has no "
            "sliding-window or Mamba group (set it to None or 0)"
        )
    if interval % scheduler_block_size:
        raise ConfigError(
            f"prefix_cache_retention_interval ({interval}) must be a multiple of "
            f"scheduler_block_size ({scheduler_block_size})"
        )


def _hit_count_fits(
    manager: SingleTypeKVCacheManager, num_blocks: int, num_new_computed_tokens: int
) -> bool:
    """Hit blocks must cover exactly the hit tokens; a Mamba group's may stop short (a KV
    connector supplies the state at the hit, so its older cached state is not used); a group
    that never caches (a replayed window) has none: the other groups decide the hit."""
    if not manager.kv_cache_spec.prefix_cacheable:
        return num_blocks == 0
    num_needed = cdiv(num_new_computed_tokens, manager.block_size)
    if isinstance(manager, MambaManager):
        return num_blocks <= num_needed
    return num_blocks == num_needed


class AllocationChecker:
    """Validates allocations against the facade's state (shared, not copied).

    `live_requests` is the facade's registry of requests holding blocks; `last_lookup` is the
    last `get_computed_blocks` result handed out, with its request and the pool's eviction
    epoch: if it comes straight back unchanged, its blocks need no per-block re-check.
    """

    def __init__(
        self,
        live_requests: dict[str, Request],
        managers: Sequence[SingleTypeKVCacheManager],
        block_pool: BlockPool,
        max_model_len: int,
        enable_caching: bool,
        hash_block_size: int,
        empty_kv_cache_blocks: KVCacheBlocks,
    ) -> None:
        self.live_requests = live_requests
        self.managers = tuple(managers)
        self.block_pool = block_pool
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.num_kv_cache_groups = len(self.managers)
        self.empty_kv_cache_blocks = empty_kv_cache_blocks
        self.empty_hits: tuple[Sequence[KVCacheBlock], ...] = tuple(() for _ in self.managers)
        self.last_lookup: tuple[Request | None, KVCacheBlocks | None, int] = (None, None, -1)
        # Strict by default: every hit block must be cached under the request's hash. The vLLM
        # drop-in turns this on, as vLLM adopts any free block a caller names (its connectors'
        # tests do): an uncached free block of this pool is then taken as a hit.
        self.accept_uncached_free_hits = False

    def record_lookup(self, request: Request, result: KVCacheBlocks) -> None:
        """Remember a lookup result handed out, at the pool's current eviction epoch."""
        self.last_lookup = (request, result, self.block_pool.eviction_epoch)

    def check_allocation(
        self,
        request: Request,
        num_new_tokens: int,
        num_new_computed_tokens: int,
        new_computed_blocks: KVCacheBlocks | None,
        num_lookahead_tokens: int,
        num_external_computed_tokens: int,
        num_encoder_tokens: int,
        reserved_blocks: int,
    ) -> tuple[Sequence[KVCacheBlock], ...]:
        """Check every argument against the current state; return the hit lists per group."""
        if not isinstance(request, Request):
            raise InvalidTypeError(
                f"request must be a pagedkv Request, got {type(request).__name__}"
            )
        counts = (
            num_new_tokens,
            num_new_computed_tokens,
            num_lookahead_tokens,
            num_external_computed_tokens,
            num_encoder_tokens,
            reserved_blocks,
        )
        # One pass in the common case; the named checks below only to word the error.
        if not all(type(count) is int and count >= 0 for count in counts):
            names = (
                "num_new_tokens",
                "num_new_computed_tokens",
                "num_lookahead_tokens",
                "num_external_computed_tokens",
                "num_encoder_tokens",
                "reserved_blocks",
            )
            for name, count in zip(names, counts, strict=True):
                check_count(name, count)
        if (
            num_new_tokens == 0
            and num_external_computed_tokens == 0
            and num_new_computed_tokens == 0
        ):
            raise InvalidArgumentError(
                "num_new_tokens must be greater than 0 when there are no computed tokens to adopt"
            )
        request_id = request.request_id
        if request.status > RequestStatus.PREEMPTED:
            raise RequestStateError(
                f"request {request_id!r} is {request.status.name}; it cannot get blocks"
            )
        live = self.live_requests.get(request_id)
        if live is not None and live is not request:
            raise RequestStateError(
                f"request id {request_id!r} is reused by a different request while the first "
                "still holds blocks; free it first"
            )
        total_tokens = (
            request.num_computed_tokens
            + num_new_computed_tokens
            + num_external_computed_tokens
            + num_new_tokens
        )
        if total_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"request {request_id!r}: {total_tokens} tokens (computed "
                f"{request.num_computed_tokens} + new computed {num_new_computed_tokens} + "
                f"external {num_external_computed_tokens} + new {num_new_tokens}) exceed "
                f"max_model_len {self.max_model_len}"
            )
        if self.enable_caching and live is None:
            hasher = request.block_hasher
            if hasher is None:
                raise RequestStateError(
                    f"request {request_id!r} has no block hasher, but prefix caching is on; "
                    "build it with block_hasher=make_request_block_hasher(...)"
                )
            if hasher.hash_block_size != self.hash_block_size:
                raise ConfigError(
                    f"request {request_id!r} is hashed in blocks of {hasher.hash_block_size} "
                    f"tokens; this manager needs {self.hash_block_size}"
                )
        if new_computed_blocks is None or new_computed_blocks is self.empty_kv_cache_blocks:
            if num_new_computed_tokens:
                raise InvalidArgumentError(
                    f"num_new_computed_tokens={num_new_computed_tokens} without hit blocks"
                )
            return self.empty_hits
        return self.check_hits(request, num_new_computed_tokens, new_computed_blocks)

    def check_hits(
        self, request: Request, num_new_computed_tokens: int, new_computed_blocks: KVCacheBlocks
    ) -> tuple[Sequence[KVCacheBlock], ...]:
        request_id = request.request_id
        hits = new_computed_blocks.blocks
        if len(hits) != self.num_kv_cache_groups:
            raise GroupIndexError(
                f"new_computed_blocks has {len(hits)} groups; the manager has "
                f"{self.num_kv_cache_groups}"
            )
        if all(not group for group in hits):
            if num_new_computed_tokens:
                raise InvalidArgumentError(
                    f"num_new_computed_tokens={num_new_computed_tokens} without hit blocks"
                )
            return self.empty_hits
        if request_id in self.live_requests or request.num_computed_tokens:
            raise RequestStateError(
                f"request {request_id!r} already has computed tokens; prefix-hit blocks can "
                "only be adopted by a request that starts (or restarts after preemption)"
            )
        looked_up_request, looked_up_blocks, epoch = self.last_lookup
        if (
            looked_up_blocks is new_computed_blocks
            and looked_up_request is request
            and epoch == self.block_pool.eviction_epoch
        ):
            # Hot path: our own lookup for this request, with no eviction since: every block
            # is still cached under the request's hashes. Only the token count is checked.
            for manager, blocks in zip(self.managers, hits, strict=True):
                if not _hit_count_fits(manager, len(blocks), num_new_computed_tokens):
                    raise InvalidArgumentError(
                        f"num_new_computed_tokens={num_new_computed_tokens} but the lookup "
                        f"found {len(blocks)} blocks of {manager.block_size} tokens"
                    )
            return hits
        pool_blocks = self.block_pool.blocks
        null_block = self.block_pool.null_block
        for group_id, (manager, blocks) in enumerate(zip(self.managers, hits, strict=True)):
            # Exactly the blocks covering the hit: extra hit blocks would be counted as cached
            # while their tokens are still to be computed (into shared blocks).
            if not _hit_count_fits(manager, len(blocks), num_new_computed_tokens):
                raise InvalidArgumentError(
                    f"num_new_computed_tokens={num_new_computed_tokens} but group {group_id} "
                    f"has {len(blocks)} hit blocks of {manager.block_size} tokens"
                )
            hashes = manager.resolve_hashes(request.block_hashes)
            for index, block in enumerate(blocks):
                if block is null_block:
                    continue
                block_id = block.block_id
                if not (0 <= block_id < len(pool_blocks)) or pool_blocks[block_id] is not block:
                    raise ForeignBlockError(
                        f"hit block {block_id} of request {request_id!r} does not belong to "
                        "this manager's pool"
                    )
                if (
                    self.accept_uncached_free_hits
                    and block.block_hash is None
                    and block.ref_cnt == 0
                ):
                    continue
                if (
                    block.block_hash is None
                    or index >= len(hashes)
                    or block.block_hash != hashes[index]
                    or block.hash_group_id != group_id
                ):
                    raise ForeignBlockError(
                        f"hit block {block_id} (position {index}, group {group_id}) is not "
                        f"cached under request {request_id!r}'s hash: a stale or foreign "
                        "get_computed_blocks result"
                    )
        return hits
