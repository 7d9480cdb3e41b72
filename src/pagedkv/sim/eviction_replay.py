"""Simulator layer: replay a trace through several eviction policies and capacities at once.

One pass over the trace feeds one manager per (policy, capacity), each built with that policy
and an optional host-memory tier. Per request, as `replay` does: device hits, then (with a
host tier) the blocks the host holds, loaded back as external tokens, then the rest; free.
`belady` reads the future from a `ReplayOracle` built in a first pass over the block keys.
The managers are the real ones, so `lru` gives exactly `replay`'s hit rates. Blocks are keyed
as in every simulator mode: by the trace's token runs (`TraceBlockHasher`), or by hashing the
tokens with `hash_tokens`. Unlike `replay`, each prompt is a real `Request` (the host tier's
lookup and load and the policies' hooks take one), built once and shared by every manager.
Each request is announced with `add_waiting` before it is served (the session policies learn
its arrival; the look-ahead has nothing to protect, since nothing waits in replay), and the
policies' clock is the trace's arrival time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pagedkv.errors import HostMemoryError, InvalidArgumentError
from pagedkv.eviction import EVICTION_POLICY_NAMES, EvictionConfig
from pagedkv.hashing import RequestBlockHasher, make_request_block_hasher
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.memory_guard import (
    BYTES_PER_POOL_BLOCK,
    HOST_TIER_BYTES_PER_BLOCK,
    ORACLE_BYTES_PER_USE,
    POLICY_BYTES_PER_BLOCK,
    check_fits,
)
from pagedkv.request import Request
from pagedkv.sim.inputs.block_keys import TraceBlockHasher
from pagedkv.sim.inputs.future import ReplayOracle, hittable_keys
from pagedkv.sim.inputs.traces import Trace, TraceRequest
from pagedkv.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, cdiv

ProgressCallback = Callable[[int], None]  # called with the number of requests done so far


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
        return list(EVICTION_POLICY_NAMES)
    names = [item.strip().lower() for item in text.split(",") if item.strip()]
    unknown = [name for name in names if name not in EVICTION_POLICY_NAMES]
    if unknown or not names:
        raise InvalidArgumentError(
            f"--eviction {text!r}: unknown policy {unknown[0] if unknown else ''!r}; choose "
            f"from {', '.join(EVICTION_POLICY_NAMES)} (comma-separated) or all"
        )
    return list(dict.fromkeys(names))


def estimate_memory_bytes(
    policies: Sequence[str],
    capacities_blocks: Sequence[int],
    num_block_uses: int,
    host_capacity_blocks: int = 0,
) -> int:
    """Resident memory a sweep needs: every manager's pool and host tier, plus the oracle for
    belady (the per-item costs are `pagedkv.memory_guard`'s)."""
    total = sum(
        (BYTES_PER_POOL_BLOCK + POLICY_BYTES_PER_BLOCK[p]) * (c + 1)
        for p in policies
        for c in capacities_blocks
    )
    if "belady" in policies:
        total += ORACLE_BYTES_PER_USE * num_block_uses
    num_pools = len(policies) * len(capacities_blocks)
    return total + HOST_TIER_BYTES_PER_BLOCK * host_capacity_blocks * num_pools


def replay_policies(
    trace: Trace,
    capacities_blocks: Sequence[int],
    policies: Sequence[str],
    block_size: int = 16,
    hash_algorithm: str = "sha256",
    host_capacity_blocks: int = 0,
    progress: ProgressCallback | None = None,
    hash_tokens: bool = False,
) -> list[PolicyPoint]:
    """Replay the trace once against a pool per (policy, capacity); results policy-major.

    Blocks are keyed by the trace's token runs (the same hits as hashing, far cheaper) unless
    `hash_tokens` hashes every prompt with `hash_algorithm`, as `replay` does.
    """
    _check(trace, capacities_blocks, policies, host_capacity_blocks)
    hasher: RequestBlockHasher
    if hash_tokens:
        hasher = make_request_block_hasher(block_size, hash_algorithm)
    else:
        hasher = TraceBlockHasher(block_size)
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
    clock = _TraceClock()
    for policy in policies:
        for capacity in capacities_blocks:
            oracle = None
            if policy == "belady":
                oracle = _oracle_for(capacity, uses, num_blocks_needed, oracles)
            eviction = EvictionConfig(
                policy=policy,
                oracle=oracle,
                host_num_blocks=host_capacity_blocks,
                clock=clock.read,
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
        clock.now_s = trace_request.arrival_time_s
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


class _TraceClock:
    """The replay's time: the arrival time of the request being served."""

    __slots__ = ("now_s",)

    def __init__(self) -> None:
        self.now_s = 0.0

    def read(self) -> float:
        return self.now_s


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
        manager.add_waiting(request)
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
            manager.remove_waiting(request)
            return
        manager.load_from_host(request, num_device, num_host)
        self.num_device_hit_tokens += num_device
        self.num_host_hit_tokens += num_host
        manager.free(request)


def _make_request(trace_request: TraceRequest, hasher: RequestBlockHasher) -> Request:
    """The prompt as a request with its block keys (a replayed prompt never grows)."""
    if not isinstance(hasher, TraceBlockHasher):
        return Request(
            trace_request.request_id,
            trace_request.prompt_token_ids(),
            block_hasher=hasher,
            session_id=trace_request.session_id,
        )
    hasher.register(trace_request.request_id, trace_request)
    try:
        return Request(
            trace_request.request_id,
            trace_request.prompt_token_ids(),
            block_hasher=hasher,
            session_id=trace_request.session_id,
        )
    finally:
        hasher.forget(trace_request.request_id)


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
        if policy not in EVICTION_POLICY_NAMES:
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
    needed = estimate_memory_bytes(
        policies, capacities_blocks, num_block_uses, host_capacity_blocks
    )
    what = (
        f"this sweep ({len(policies)} policies x {len(capacities_blocks)} capacities, "
        f"{sum(capacities_blocks):,} blocks each)"
    )
    try:
        check_fits(what, needed)
    except HostMemoryError as exc:
        raise HostMemoryError(
            f"{exc}: run fewer policies or capacities at a time", needed, exc.available_bytes or 0
        ) from None
