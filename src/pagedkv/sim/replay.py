"""Simulator layer: replay mode, a prefix-cache capacity study.

Requests go through the manager one at a time, in trace order: look up the cached prefix,
allocate the prompt (which caches its full blocks), free. Block keys come from the trace's token
runs (`block_keys`), so no prompt is built or hashed; a sweep of several capacities runs one
process per capacity, or one pass feeding every capacity. No scheduler, no time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from pagedkv.block import BlockHash
from pagedkv.errors import InvalidArgumentError
from pagedkv.hashing import make_request_block_hasher
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from pagedkv.sim import processes
from pagedkv.sim.inputs.block_keys import TraceBlockKeys
from pagedkv.sim.inputs.traces import Trace
from pagedkv.sim.processes import JobProgress
from pagedkv.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, cdiv

ProgressCallback = Callable[[int], None]  # called with the number of requests done so far

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}
_CAPACITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmg]?)\s*(tok|tokens|blk|blocks)?\s*$", re.I)


def parse_capacities(text: str, block_size: int) -> list[int | None]:
    """Parse `1000,5000,20k,1M,4Mtok,unlimited` into capacities in blocks (None: unlimited).

    A plain number (optional k/M/G suffix, or `blocks`) counts blocks; a `tok` suffix counts
    tokens, rounded down to whole blocks.
    """
    capacities: list[int | None] = []
    for item in text.split(","):
        if not item.strip():
            continue
        if item.strip().lower() in ("unlimited", "inf"):
            capacities.append(None)
            continue
        match = _CAPACITY.match(item)
        if match is None:
            raise InvalidArgumentError(
                f"capacity {item.strip()!r} is not a count like 5000, 20k, 1M or 4Mtok"
            )
        number, suffix, unit = match.groups()
        count = int(float(number) * _SUFFIXES[suffix.lower()])
        num_blocks = count // block_size if unit and unit.lower().startswith("tok") else count
        if num_blocks < 1:
            raise InvalidArgumentError(
                f"capacity {item.strip()!r} is less than one block of {block_size} tokens"
            )
        capacities.append(num_blocks)
    if not capacities:
        raise InvalidArgumentError(f"no capacity in {text!r}")
    return capacities


def default_capacities(trace: Trace, block_size: int) -> list[int]:
    """1 %, 3 %, 10 %, 30 % and 100 % of the blocks of all prompts together (two significant
    digits); 100 % never evicts, so it is the trace's reuse ceiling at this block size."""
    total = sum(cdiv(request.num_prompt_tokens, block_size) for request in trace.requests)
    capacities = []
    for fraction in (0.01, 0.03, 0.1, 0.3):
        value = max(1, int(total * fraction))
        digits = len(str(value)) - 2
        capacities.append(max(1, value // 10**digits * 10**digits) if digits > 0 else value)
    capacities.append(total)
    return sorted(set(capacities))


@dataclass(frozen=True, slots=True)
class ReplayPoint:
    """Result at one capacity (`capacity_blocks=None`: unlimited, every block stays cached).

    `hit_rate = num_hit_tokens / num_prompt_tokens`; a request whose prompt does not fit in
    the whole pool is skipped and counts as all misses (`num_requests_not_fit`).
    """

    capacity_blocks: int | None
    num_hit_tokens: int
    num_prompt_tokens: int
    num_requests_not_fit: int

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0


def replay(
    trace: Trace,
    capacities_blocks: Sequence[int | None],
    block_size: int = 16,
    hash_algorithm: str = "sha256",
    progress: ProgressCallback | None = None,
    kv_cache_groups: Sequence[KVCacheGroupSpec] | None = None,
    hash_tokens: bool = False,
    max_workers: int = 1,
) -> list[ReplayPoint]:
    """Replay the trace once against a pool of each capacity; results in the given order.

    By default blocks are keyed by the trace's token runs (`TraceBlockKeys`), which gives the
    same hits, evictions and block ids as hashing every prompt; `hash_tokens=True` builds and
    hashes the prompts instead (with `hash_algorithm`). A capacity that holds every prompt
    block of the trace never evicts, so it is computed as `None` (unlimited) is: every full
    block ever seen stays cached. `max_workers > 1` replays several capacities in that many
    processes (where `fork` exists), one capacity per process at a time.

    `kv_cache_groups`: a real model's KV-cache groups (`pagedkv.sizing.get_kv_cache_layout`)
    instead of one synthetic full-attention group of `block_size`. Each capacity is then the
    block count of a pool shared by all groups, requests are built and hashed at the managers'
    `hash_block_size` (the gcd of the group block sizes), and an unlimited capacity is refused:
    the set-of-seen-blocks shortcut is exact for full attention only.
    """
    if not capacities_blocks:
        raise InvalidArgumentError("replay needs at least one capacity")
    if not isinstance(max_workers, int) or max_workers < 1:
        raise InvalidArgumentError(f"max_workers must be an int >= 1, got {max_workers!r}")
    if kv_cache_groups is not None:
        if None in capacities_blocks:
            raise InvalidArgumentError(
                "an unlimited capacity needs the synthetic full-attention layout, "
                "not a model's KV-cache groups"
            )
        groups = tuple(kv_cache_groups)
    else:
        groups = (_synthetic_group(block_size),)
    if kv_cache_groups is not None or hash_tokens:
        outcomes = _replay_hashed(
            trace, capacities_blocks, groups, block_size, hash_algorithm, progress
        )
    else:
        outcomes = _replay_sweep(trace, capacities_blocks, block_size, progress, max_workers)
    num_prompt_tokens = trace.num_prompt_tokens
    return [
        ReplayPoint(capacity, num_hit_tokens, num_prompt_tokens, num_not_fit)
        for capacity, (num_hit_tokens, num_not_fit) in zip(capacities_blocks, outcomes, strict=True)
    ]


Outcome = tuple[int, int]  # (hit tokens, requests that did not fit) at one capacity


def _synthetic_group(block_size: int) -> KVCacheGroupSpec:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=1)
    return KVCacheGroupSpec(("layer",), spec)


def _make_managers(
    trace: Trace, capacities_blocks: Sequence[int], groups: tuple[KVCacheGroupSpec, ...]
) -> list[KVCacheManager]:
    max_model_len = max(request.num_prompt_tokens for request in trace.requests)
    return [
        KVCacheManager(KVCacheConfig(capacity + 1, groups), max_model_len)
        for capacity in capacities_blocks
    ]


def _replay_sweep(
    trace: Trace,
    capacities_blocks: Sequence[int | None],
    block_size: int,
    progress: ProgressCallback | None,
    max_workers: int,
) -> list[Outcome]:
    """Keyed replay of every capacity: pools that may evict, and one seen-set for the rest."""
    total_blocks = sum(cdiv(request.num_prompt_tokens, block_size) for request in trace.requests)
    # Largest first: in processes, the longest jobs start first.
    pools = sorted(
        {capacity for capacity in capacities_blocks if capacity is not None}, reverse=True
    )
    pools = [capacity for capacity in pools if capacity < total_blocks]
    never_evict = len(pools) < len(set(capacities_blocks))
    jobs: list[int | None] = [*pools, None] if never_evict else list(pools)
    if max_workers > 1 and len(pools) > 1 and processes.can_fork():
        arguments = [(trace, capacity, block_size) for capacity in jobs]
        outcomes = processes.run_jobs(
            _replay_job, arguments, max_workers, len(trace.requests), progress
        )
    else:
        outcomes = _replay_keyed(trace, jobs, block_size, progress)
    by_capacity = dict(zip(jobs, outcomes, strict=True))
    return [
        by_capacity[capacity if capacity is not None and capacity < total_blocks else None]
        for capacity in capacities_blocks
    ]


def _replay_keyed(
    trace: Trace,
    capacities_blocks: Sequence[int | None],
    block_size: int,
    progress: ProgressCallback | None,
) -> list[Outcome]:
    """One pass over the trace keyed by token runs, feeding a pool of every capacity."""
    limited = [capacity for capacity in capacities_blocks if capacity is not None]
    managers = _make_managers(trace, limited, (_synthetic_group(block_size),))
    steps = [manager.try_prefill_and_free for manager in managers]
    hits = [0] * len(managers)
    not_fit = [0] * len(managers)
    unlimited = _UnlimitedCache(block_size) if None in capacities_blocks else None
    keyer = TraceBlockKeys(block_size)
    for index, trace_request in enumerate(trace.requests):
        # Ints, not digests: the pool only compares keys, and these are equal iff the prefixes
        # are (block_keys.TraceBlockKeys).
        keys = cast(list[BlockHash], keyer.get_keys(trace_request))
        num_tokens = trace_request.num_prompt_tokens
        for position, step in enumerate(steps):
            num_hit = step(keys, num_tokens)
            if num_hit is None:
                not_fit[position] += 1
            else:
                hits[position] += num_hit
        if unlimited is not None:
            unlimited.lookup_and_insert(keys, num_tokens)
        if progress is not None:
            progress(index + 1)
    return _outcomes(capacities_blocks, hits, not_fit, unlimited)


def _replay_hashed(
    trace: Trace,
    capacities_blocks: Sequence[int | None],
    groups: tuple[KVCacheGroupSpec, ...],
    block_size: int,
    hash_algorithm: str,
    progress: ProgressCallback | None,
) -> list[Outcome]:
    """One pass building and hashing every prompt, through the scheduler-facing calls."""
    limited = [capacity for capacity in capacities_blocks if capacity is not None]
    managers = _make_managers(trace, limited, groups)
    hits = [0] * len(managers)
    not_fit = [0] * len(managers)
    unlimited = _UnlimitedCache(block_size) if None in capacities_blocks else None
    hash_block_size = managers[0].hash_block_size if managers else block_size
    hasher = make_request_block_hasher(hash_block_size, hash_algorithm)
    for index, trace_request in enumerate(trace.requests):
        request = Request(
            trace_request.request_id, trace_request.prompt_token_ids(), block_hasher=hasher
        )
        num_tokens = request.num_tokens
        for position, manager in enumerate(managers):
            hit_blocks, num_hit, _ = manager.get_computed_blocks(request)
            allocated = manager.allocate_slots(
                request,
                num_tokens - num_hit,
                num_new_computed_tokens=num_hit,
                new_computed_blocks=hit_blocks,
                has_scheduled_reqs=False,
            )
            if allocated is None:
                not_fit[position] += 1
                continue
            hits[position] += num_hit
            manager.free(request)
        if unlimited is not None:
            unlimited.lookup_and_insert(request.block_hashes, num_tokens)
        if progress is not None:
            progress(index + 1)
    return _outcomes(capacities_blocks, hits, not_fit, unlimited)


def _outcomes(
    capacities_blocks: Sequence[int | None],
    hits: list[int],
    not_fit: list[int],
    unlimited: _UnlimitedCache | None,
) -> list[Outcome]:
    """Per capacity, in order: the pools' tallies in turn, the seen-set's for `None`."""
    limited = iter(zip(hits, not_fit, strict=True))
    return [
        next(limited) if capacity is not None else (_num_hits(unlimited), 0)
        for capacity in capacities_blocks
    ]


def _num_hits(unlimited: _UnlimitedCache | None) -> int:
    if unlimited is None:
        raise InvalidArgumentError("no unlimited capacity was replayed")
    return unlimited.num_hit_tokens


def _replay_job(argument: tuple[Trace, int | None, int], report: JobProgress) -> Outcome:
    """One capacity in a worker process (`processes.run_jobs`)."""
    trace, capacity, block_size = argument
    (outcome,) = _replay_keyed(trace, [capacity], block_size, report)
    return outcome


class _UnlimitedCache:
    """The hits an infinite pool would give: every full block ever seen stays cached.

    `num_hit_tokens` sums the hits of every prompt looked up so far.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[BlockHash] = set()
        self.num_hit_tokens = 0

    def lookup_and_insert(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """Count the prompt's cached prefix (keeping one token to compute), then cache it."""
        seen = self.seen
        max_blocks = (num_tokens - 1) // self.block_size
        num_hit = 0
        while num_hit < max_blocks and block_hashes[num_hit] in seen:
            num_hit += 1
        seen.update(block_hashes)
        self.num_hit_tokens += num_hit * self.block_size
