"""Simulator layer: replay a trace through several eviction policies and capacities at once.

One pass over the trace feeds one manager per (policy, capacity), each built with that policy
and an optional host-memory tier. Per request, as `replay` does: device hits, then (with a
host tier) the blocks the host holds, loaded back as external tokens, then the rest; free.
`belady` reads the future from a `ReplayOracle` built in a first pass over the block keys.
The managers are the real ones, so `lru` gives exactly `replay`'s hit rates.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError
from pagedkv.eviction import POLICY_NAMES, EvictionConfig
from pagedkv.hashing import RequestBlockHasher, make_request_block_hasher
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from pagedkv.sim.future import ReplayOracle, hittable_keys
from pagedkv.sim.traces import Trace, TraceRequest
from pagedkv.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, cdiv

ProgressCallback = Callable[[int], None]  # called with the number of requests done so far

# Resident bytes per block of a pool with SHA-256 keys after two full turnovers (block, links,
# hash and hash-map entry, the policy's per-block state and ghosts), measured with tracemalloc
# (100k-block pools) and rounded up; the oracle's bytes per block use include the key lists it
# keeps. The full conversation trace at block size 16, all six policies at 1M-16M tokens,
# estimates 5.2 GiB and ran at about 4.8 GiB resident. Used to refuse a sweep that would not
# fit in memory, before building it.
BYTES_PER_BLOCK = {"lru": 320, "lfu": 330, "s3fifo": 580, "arc": 320, "cost": 400, "belady": 380}
ORACLE_BYTES_PER_USE = 120


@dataclass(frozen=True, slots=True)
class PolicyPoint:
    """One policy at one capacity (and host capacity, 0: no host tier).

    `hit_rate`: tokens hit in the device pool / prompt tokens; `host_hit_rate`: tokens loaded
    from the host tier / prompt tokens; a prompt larger than the pool is skipped and counts as
    all misses (`num_requests_not_fit`).
    """

    policy: str
    capacity_blocks: int
    host_capacity_blocks: int
    num_device_hit_tokens: int
    num_host_hit_tokens: int
    num_prompt_tokens: int
    num_requests_not_fit: int

    @property
    def hit_rate(self) -> float:
        num_prompt_tokens = self.num_prompt_tokens
        return self.num_device_hit_tokens / num_prompt_tokens if num_prompt_tokens else 0.0

    @property
    def host_hit_rate(self) -> float:
        return self.num_host_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def parse_policies(text: str) -> list[str]:
    """Parse `lru,lfu,belady` (or `all`) into policy names, in the order given."""
    if text.strip().lower() == "all":
        return list(POLICY_NAMES)
    names = [item.strip().lower() for item in text.split(",") if item.strip()]
    unknown = [name for name in names if name not in POLICY_NAMES]
    if unknown or not names:
        raise InvalidArgumentError(
            f"--eviction {text!r}: unknown policy {unknown[0] if unknown else ''!r}; choose "
            f"from {', '.join(POLICY_NAMES)} (comma-separated) or all"
        )
    return list(dict.fromkeys(names))


def estimate_memory_bytes(
    policies: Sequence[str], capacities_blocks: Sequence[int], num_block_uses: int
) -> int:
    """Resident memory a sweep needs: every manager's pool, plus the oracle for belady."""
    total = sum(BYTES_PER_BLOCK[p] * (c + 1) for p in policies for c in capacities_blocks)
    if "belady" in policies:
        total += ORACLE_BYTES_PER_USE * num_block_uses
    return total


def available_memory_bytes() -> int | None:
    """Memory the system can still give this process: Linux's MemAvailable (free memory plus
    reclaimable caches), else free pages; None where the OS does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def replay_policies(
    trace: Trace,
    capacities_blocks: Sequence[int],
    policies: Sequence[str],
    block_size: int = 16,
    hash_algorithm: str = "sha256",
    host_capacity_blocks: int = 0,
    progress: ProgressCallback | None = None,
) -> list[PolicyPoint]:
    """Replay the trace once against a pool per (policy, capacity); results policy-major."""
    _check(trace, capacities_blocks, policies, host_capacity_blocks)
    hasher = make_request_block_hasher(block_size, hash_algorithm)
    max_model_len = max(request.num_prompt_tokens for request in trace.requests)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=1)
    groups = (KVCacheGroupSpec(("layer",), spec),)
    num_blocks_needed = [cdiv(r.num_prompt_tokens, block_size) for r in trace.requests]
    oracles: dict[int, ReplayOracle] = {}
    uses: list[Sequence[Hashable]] = []
    if "belady" in policies:
        uses = [
            hittable_keys(_make_request(r, hasher).block_hashes, r.num_prompt_tokens, block_size)
            for r in trace.requests
        ]
    num_block_uses = sum(len(keys) for keys in uses)
    _check_memory(policies, capacities_blocks, host_capacity_blocks, num_block_uses)
    lanes = []
    for policy in policies:
        for capacity in capacities_blocks:
            oracle = None
            if policy == "belady":
                oracle = _oracle_for(capacity, uses, num_blocks_needed, oracles)
            eviction = EvictionConfig(
                policy=policy, oracle=oracle, host_num_blocks=host_capacity_blocks
            )
            manager = KVCacheManager(
                KVCacheConfig(capacity + 1, groups), max_model_len, eviction=eviction
            )
            lanes.append(_Lane(policy, capacity, manager))
    advancing = list({id(oracle): oracle for oracle in oracles.values()}.values())
    for index, trace_request in enumerate(trace.requests):
        for oracle in advancing:
            oracle.advance(index)
        request = _make_request(trace_request, hasher)
        for lane in lanes:
            lane.serve(request)
        if progress is not None:
            progress(index + 1)
    return [
        PolicyPoint(
            lane.policy,
            lane.capacity_blocks,
            host_capacity_blocks,
            lane.num_device_hit_tokens,
            lane.num_host_hit_tokens,
            trace.num_prompt_tokens,
            lane.num_requests_not_fit,
        )
        for lane in lanes
    ]


class _Lane:
    """One manager of the sweep and its tallies."""

    __slots__ = (
        "policy",
        "capacity_blocks",
        "manager",
        "num_device_hit_tokens",
        "num_host_hit_tokens",
        "num_requests_not_fit",
    )

    def __init__(self, policy: str, capacity_blocks: int, manager: KVCacheManager) -> None:
        self.policy = policy
        self.capacity_blocks = capacity_blocks
        self.manager = manager
        self.num_device_hit_tokens = self.num_host_hit_tokens = self.num_requests_not_fit = 0

    def serve(self, request: Request) -> None:
        manager = self.manager
        hit_blocks, num_device, _ = manager.get_computed_blocks(request)
        num_host = manager.get_num_host_hit_tokens(request, num_device)
        allocated = manager.allocate_slots(
            request,
            request.num_tokens - num_device - num_host,
            num_new_computed_tokens=num_device,
            new_computed_blocks=hit_blocks,
            num_external_computed_tokens=num_host,
            has_scheduled_reqs=False,
        )
        if allocated is None:
            self.num_requests_not_fit += 1
            return
        manager.load_from_host(request, num_device, num_host)
        self.num_device_hit_tokens += num_device
        self.num_host_hit_tokens += num_host
        manager.free(request)


def _make_request(trace_request: TraceRequest, hasher: RequestBlockHasher) -> Request:
    return Request(trace_request.request_id, trace_request.prompt_token_ids(), block_hasher=hasher)


def _oracle_for(
    capacity_blocks: int,
    uses: Sequence[Sequence[Hashable]],
    num_blocks_needed: Sequence[int],
    oracles: dict[int, ReplayOracle],
) -> ReplayOracle:
    """The future at this capacity: a prompt larger than the pool is never served, so it
    uses nothing. Capacities that skip the same prompts share one oracle."""
    if capacity_blocks in oracles:
        return oracles[capacity_blocks]
    skipped = tuple(i for i, n in enumerate(num_blocks_needed) if n > capacity_blocks)
    for other_capacity, oracle in list(oracles.items()):
        other = tuple(i for i, n in enumerate(num_blocks_needed) if n > other_capacity)
        if other == skipped:
            oracles[capacity_blocks] = oracle
            return oracle
    skipped_set = set(skipped)
    oracle = ReplayOracle([() if i in skipped_set else keys for i, keys in enumerate(uses)])
    oracles[capacity_blocks] = oracle
    return oracle


def _check(
    trace: Trace,
    capacities_blocks: Sequence[int | None],
    policies: Sequence[str],
    host_capacity_blocks: int,
) -> None:
    if not trace.requests:
        raise InvalidArgumentError("the trace has no requests")
    if not policies or not capacities_blocks:
        raise InvalidArgumentError("an eviction replay needs at least one policy and capacity")
    for capacity in capacities_blocks:
        if capacity is None:
            raise InvalidArgumentError(
                "an unlimited capacity evicts nothing, so every policy gives the same hit "
                "rate: give finite capacities with --eviction"
            )
    for policy in policies:
        if policy not in POLICY_NAMES:
            raise InvalidArgumentError(f"unknown eviction policy {policy!r}")
    if type(host_capacity_blocks) is not int or host_capacity_blocks < 0:
        raise InvalidArgumentError(f"host capacity {host_capacity_blocks!r} must be >= 0 blocks")


def _check_memory(
    policies: Sequence[str],
    capacities_blocks: Sequence[int],
    host_capacity_blocks: int,
    num_block_uses: int,
) -> None:
    """Refuse, with the numbers, a sweep the machine cannot hold (before building it)."""
    needed = estimate_memory_bytes(policies, capacities_blocks, num_block_uses)
    needed += 120 * host_capacity_blocks * len(policies) * len(capacities_blocks)
    available = available_memory_bytes()
    if available is not None and needed > available:
        raise InvalidArgumentError(
            f"this sweep needs about {needed / 2**30:.1f} GiB ({len(policies)} policies x "
            f"{len(capacities_blocks)} capacities, {sum(capacities_blocks):,} blocks each), "
            f"but only {available / 2**30:.1f} GiB is available: run fewer policies or "
            "capacities at a time"
        )
