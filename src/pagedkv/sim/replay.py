"""Simulator layer: replay mode, a prefix-cache capacity study.

Requests go through the manager one at a time, in trace order: look up the cached prefix,
allocate the prompt (which caches its full blocks), free. One pass over the trace feeds every
capacity of the sweep, so each prompt is built and hashed once. No scheduler, no time.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError
from pagedkv.hashing import make_request_block_hasher
from pagedkv.kv_cache_manager import KVCacheManager
from pagedkv.request import Request
from pagedkv.sim.traces import Trace
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
) -> list[ReplayPoint]:
    """Replay the trace once against a pool of each capacity; results in the given order.

    `kv_cache_groups`: a real model's KV-cache groups (`pagedkv.sizing.get_kv_cache_layout`)
    instead of one synthetic full-attention group of `block_size`. Each capacity is then the
    block count of a pool shared by all groups, requests are hashed at the managers'
    `hash_block_size` (the gcd of the group block sizes), and an unlimited capacity is refused:
    the set-of-seen-blocks shortcut is exact for full attention only.
    """
    if not capacities_blocks:
        raise InvalidArgumentError("replay needs at least one capacity")
    if kv_cache_groups is None:
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype_bytes=1)
        groups: tuple[KVCacheGroupSpec, ...] = (KVCacheGroupSpec(("layer",), spec),)
    else:
        if None in capacities_blocks:
            raise InvalidArgumentError(
                "an unlimited capacity needs the synthetic full-attention layout, "
                "not a model's KV-cache groups"
            )
        groups = tuple(kv_cache_groups)
    max_model_len = max(request.num_prompt_tokens for request in trace.requests)
    managers = [
        KVCacheManager(KVCacheConfig(capacity + 1, groups), max_model_len)
        for capacity in capacities_blocks
        if capacity is not None
    ]
    num_limited = len(managers)
    hits = [0] * len(capacities_blocks)
    not_fit = [0] * len(capacities_blocks)
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
            hits[num_limited] += unlimited.lookup_and_insert(request)
        if progress is not None:
            progress(index + 1)
    num_prompt_tokens = trace.num_prompt_tokens
    limited = iter(range(num_limited))
    points = []
    for capacity in capacities_blocks:
        position = num_limited if capacity is None else next(limited)
        points.append(ReplayPoint(capacity, hits[position], num_prompt_tokens, not_fit[position]))
    return points


class _UnlimitedCache:
    """The hits an infinite pool would give: every full block ever seen stays cached."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.seen: set[bytes] = set()

    def lookup_and_insert(self, request: Request) -> int:
        hashes = request.block_hashes
        seen = self.seen
        max_blocks = (request.num_tokens - 1) // self.block_size  # keep one token to compute
        num_hit = 0
        while num_hit < max_blocks and hashes[num_hit] in seen:
            num_hit += 1
        seen.update(hashes)
        return num_hit * self.block_size
