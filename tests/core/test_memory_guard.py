"""Memory estimates before building: impossible sizes are refused with the estimate and the
limit, nothing is built, and small structures never ask the operating system."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import tracemalloc

import pytest

from pagedkv import (
    BlockPool,
    HostMemoryError,
    KVCacheConfig,
    KVCacheManager,
    PagedKVError,
    Request,
    make_request_block_hasher,
    memory_guard,
)
from pagedkv.memory_guard import (
    BYTES_PER_POOL_BLOCK,
    MemoryBudget,
    check_fits,
    format_bytes,
)
from tests.support.builders import full_config
from tests.support.paths import SRC_DIR

SRC = SRC_DIR
GIB = 2**30


@pytest.fixture
def eight_gib(monkeypatch):
    """This machine has 8 GiB available, whatever it really has."""
    monkeypatch.setattr(memory_guard, "available_memory_bytes", lambda: 8 * GIB)


def test_a_billion_block_manager_is_refused_before_anything_is_built(eight_gib):
    tracemalloc.start()
    try:
        with pytest.raises(HostMemoryError) as caught:
            KVCacheManager(full_config(10**9), max_model_len=4096)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    error = caught.value
    assert isinstance(error, PagedKVError) and isinstance(error, ValueError)
    assert error.needed_bytes == 10**9 * BYTES_PER_POOL_BLOCK
    assert error.available_bytes == 8 * GIB
    assert str(error) == (
        "a pool of 1,000,000,000 blocks needs an estimated 260.8 GiB of memory; this machine "
        "has 8.0 GiB available"
    )
    assert peak_bytes < 2**20  # refused from the count: not one block was built


def test_only_pools_past_the_threshold_read_the_machine_and_those_that_fit_are_built(
    monkeypatch,
):
    reads = []

    def available() -> int:
        reads.append(1)
        return 8 * GIB

    monkeypatch.setattr(memory_guard, "available_memory_bytes", available)
    monkeypatch.setattr(memory_guard, "MIN_CHECKED_BYTES", 1000 * BYTES_PER_POOL_BLOCK)
    KVCacheManager(full_config(999), max_model_len=64)
    assert reads == []
    pool = BlockPool(1000)  # checked, and it fits
    assert reads == [1] and pool.get_num_free_blocks() == 999


def test_unknown_availability_lets_everything_through(monkeypatch):
    monkeypatch.setattr(memory_guard, "available_memory_bytes", lambda: None)
    check_fits("anything", 10**18)
    budget = MemoryBudget("a trace", "line")
    budget.add(10**18, 1)
    assert budget.num_bytes == 10**18


def test_check_fits_names_what_the_estimate_and_the_limit():
    check_fits("x", 100, available_bytes=100)
    message = (
        r"^the sweep needs an estimated 1\.5 GiB of memory; this machine has 1\.0 GiB available$"
    )
    with pytest.raises(HostMemoryError, match=message):
        check_fits("the sweep", 3 * GIB // 2, available_bytes=GIB)


def test_memory_budget_reads_the_machine_once_and_refuses_past_it(monkeypatch):
    reads = []

    def available() -> int:
        reads.append(1)
        return memory_guard.MIN_CHECKED_BYTES * 3

    monkeypatch.setattr(memory_guard, "available_memory_bytes", available)
    budget = MemoryBudget("loading t.jsonl", "line")
    budget.add(memory_guard.MIN_CHECKED_BYTES - 1, 1)
    assert reads == []  # below the threshold: no read
    budget.add(memory_guard.MIN_CHECKED_BYTES, 2)
    budget.add(memory_guard.MIN_CHECKED_BYTES, 3)
    assert reads == [1]
    with pytest.raises(HostMemoryError, match=r"^loading t\.jsonl \(up to line 4\) needs"):
        budget.add(2, 4)
    assert reads == [1]


def test_format_bytes():
    assert [format_bytes(n) for n in (512, 2048, 5 * 2**20, 3 * GIB // 2, 2**41)] == [
        "512 bytes",
        "2.0 KiB",
        "5.0 MiB",
        "1.5 GiB",
        "2.0 TiB",
    ]


def test_available_memory_respects_ulimit_v():
    # A real process under `ulimit -v 2GiB`: what is left is below the limit, and a pool that
    # would need more than that is refused from its size instead of failing half-built.
    code = textwrap.dedent(
        """
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, resource.RLIM_INFINITY))
        from pagedkv import BlockPool, HostMemoryError
        from pagedkv.memory_guard import available_memory_bytes
        left = available_memory_bytes()
        assert 0 < left < 2 * 2**30, left
        try:
            BlockPool(10_000_000)  # 2.8 GB estimated
        except HostMemoryError as error:
            print(error)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC)},
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("a pool of 10,000,000 blocks needs an estimated 2.6 GiB")


def test_a_manager_without_groups_manages_nothing_as_the_reference():
    # An attention-free model keeps no KV cache: vLLM still builds its manager (with the
    # no-prefix-cache coordinator) and every request gets empty tables; the drop-in must too.
    # Nothing is hashed, so any hasher (or none) is fine: no misleading block-size error later.
    manager = KVCacheManager(KVCacheConfig(num_blocks=10, kv_cache_groups=[]), max_model_len=100)
    request = Request("a", [1, 2, 3], block_hasher=make_request_block_hasher(16))
    assert manager.get_computed_blocks(request).num_computed_tokens == 0
    assert manager.allocate_slots(request, 3).blocks == ()
    assert manager.get_block_ids("a") == ()
    manager.free(request)
    assert manager.usage == 0.0
    unhashed = Request("b", [1, 2, 3])
    assert manager.allocate_slots(unhashed, 3).blocks == ()
    manager.free(unhashed)
