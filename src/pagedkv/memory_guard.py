"""Leaf: this machine's memory guard: what pagedkv's own structures cost in RAM, what the
machine has left, and the one check between the two (not the host-memory *tier* of evicted KV
blocks, which is `pagedkv.eviction.host_tier`).

Builders estimate first and call `check_fits` before allocating anything large, so a size that
cannot fit is refused with the estimate and the limit instead of ending in a `MemoryError` or
the OOM killer. Imports no pagedkv structure: their per-item costs are measured constants.
"""

from __future__ import annotations

import os

from pagedkv.errors import HostMemoryError

try:
    import resource
except ImportError:  # pragma: no cover - not a Unix system: no `ulimit -v` to respect
    resource = None  # type: ignore[assignment]  # None stands for "no resource module"

# Measured with tracemalloc on CPython 3.11 (`python benchmarks/bench_memory.py`): a pool block
# costs 128 bytes built (the block, its id, the pool's list slot) and about 248 once it holds a
# cached SHA-256 hash (the 32-byte key and its dict entries); rounded up for dict growth steps.
BYTES_PER_POOL_BLOCK = 280
# What a pool with an eviction policy holds per block beyond that once it has turned over
# (resident bytes after two full turnovers of 100k-block pools with SHA-256 keys, measured with
# tracemalloc and rounded up: hash-map growth, the policy's per-block state and its ghosts).
# The full conversation trace at block size 16, all six policies at 1M-16M tokens, estimates
# 5.2 GiB this way and ran at about 4.8 GiB resident.
POLICY_BYTES_PER_BLOCK = {
    "lru": 40,
    "lfu": 50,
    "s3fifo": 300,
    "arc": 40,
    "cost": 120,
    "continuation": 50,
    "hazard": 60,
    "belady": 100,
}
# The belady oracle, per block use of the trace (the key lists it keeps).
ORACLE_BYTES_PER_USE = 120
# An entry of the host-memory tier (a hash key in an OrderedDict), as the eviction sweep counts it.
HOST_TIER_BYTES_PER_BLOCK = 120
# A prompt held as a request: its token list (a pointer and an int object per token), the
# packed bytes hashed and its block hashes, measured at block size 16 (about 45 per token).
BYTES_PER_PROMPT_TOKEN = 64
# A request of a synthetic workload (`pagedkv.sim.inputs.workloads`), its token runs included
# (~550).
BYTES_PER_WORKLOAD_REQUEST = 600
# Building a structure below this size never asks the operating system how much is left.
MIN_CHECKED_BYTES = 64 * 2**20

_PROC_MEMINFO = "/proc/meminfo"
_CGROUP_LIMITS = (  # (limit file, usage file): cgroup v2, then v1
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
    ),
)


def format_bytes(num_bytes: int) -> str:
    """`1.5 GiB`, `120.0 MiB`, `512 bytes`: for messages."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:,.1f} {unit}"
    return f"{num_bytes} bytes"


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as file:
            text = file.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _meminfo_available_bytes() -> int | None:
    try:
        with open(_PROC_MEMINFO, encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        return None
    try:  # not Linux: the physical pages free now
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _address_space_left_bytes() -> int | None:
    """What `ulimit -v` (RLIMIT_AS) still allows this process to map, if it is set."""
    if resource is None:
        return None
    limit, _ = resource.getrlimit(resource.RLIMIT_AS)
    if limit == resource.RLIM_INFINITY:
        return None
    try:
        with open("/proc/self/statm", encoding="ascii") as file:
            mapped_bytes = int(file.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        mapped_bytes = 0
    return max(0, limit - mapped_bytes)


def available_memory_bytes() -> int | None:
    """Bytes this process can still allocate: the least of the machine's MemAvailable, its
    cgroup's limit minus usage, and `ulimit -v` minus what is mapped; None if none is known."""
    candidates = [_meminfo_available_bytes(), _address_space_left_bytes()]
    for limit_path, usage_path in _CGROUP_LIMITS:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 2**60:
            candidates.append(max(0, limit - usage))
    known = [value for value in candidates if value is not None]
    return min(known) if known else None


def check_fits(what: str, num_bytes: int, available_bytes: int | None = None) -> None:
    """Raise `HostMemoryError` if building `what` (an estimated `num_bytes`) cannot fit.

    `available_bytes` defaults to `available_memory_bytes()`, read only for estimates of at
    least `MIN_CHECKED_BYTES`. Unknown availability lets everything through.
    """
    if available_bytes is None:
        if num_bytes < MIN_CHECKED_BYTES:
            return
        available_bytes = available_memory_bytes()
        if available_bytes is None:
            return
    if num_bytes > available_bytes:
        raise _refusal(what, num_bytes, available_bytes)


def _refusal(what: str, num_bytes: int, available_bytes: int) -> HostMemoryError:
    return HostMemoryError(
        f"{what} needs an estimated {format_bytes(num_bytes)} of memory; this machine has "
        f"{format_bytes(available_bytes)} available",
        num_bytes,
        available_bytes,
    )


class MemoryBudget:
    """A running estimate of what a loader has built so far, refused once it passes what was
    available when the estimate first reached `MIN_CHECKED_BYTES` (read once, then)."""

    def __init__(self, what: str, position_name: str) -> None:
        self.what = what
        self.position_name = position_name  # what `add`'s positions count: "line", "request"
        self.num_bytes = 0
        self.available_bytes: int | None = None
        self._checked = False

    def add(self, num_bytes: int, position: int) -> None:
        """Count `num_bytes` more, built for `position`; raise `HostMemoryError` (naming it)
        once the total cannot fit."""
        self.num_bytes += num_bytes
        if self.num_bytes < MIN_CHECKED_BYTES:
            return
        if not self._checked:
            self.available_bytes = available_memory_bytes()
            self._checked = True
        if self.available_bytes is not None and self.num_bytes > self.available_bytes:
            where = f"{self.what} (up to {self.position_name} {position})"
            raise _refusal(where, self.num_bytes, self.available_bytes)
