"""vLLM's own schedulers, building pagedkv's manager instead of vLLM's.

`--scheduler-cls pagedkv.integrations.vllm.Scheduler` is the switch: vLLM's `Scheduler`
unchanged, except that the `KVCacheManager` its constructor builds is `PagedKVCacheManager`.
When vLLM's async scheduling is on, the same name yields the async variant, as vLLM's
default does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.sched import async_scheduler as vllm_async_scheduler
from vllm.v1.core.sched import scheduler as vllm_scheduler

from pagedkv.integrations.vllm.manager import PagedKVCacheManager

_SWAP_LOCK = threading.Lock()


@contextmanager
def manager_class_in_vllm_scheduler(manager_class: type) -> Iterator[None]:
    """Make vLLM's scheduler module build `manager_class` while the block runs.

    vLLM's `Scheduler.__init__` names its manager class through a module global; swapping it
    for the duration of one constructor (under a lock, restored afterwards) reuses vLLM's
    constructor as it is instead of copying it.
    """
    # The ignores: vLLM types the global as its manager class, which pagedkv's only mirrors
    # (unused-ignore: where vLLM is not installed, the module is untyped).
    with _SWAP_LOCK:
        original = vllm_scheduler.KVCacheManager
        vllm_scheduler.KVCacheManager = manager_class  # type: ignore[assignment, misc, unused-ignore]
        try:
            yield
        finally:
            vllm_scheduler.KVCacheManager = original  # type: ignore[misc, unused-ignore]


class Scheduler(vllm_scheduler.Scheduler):
    """vLLM's `Scheduler` on pagedkv's KV-cache manager (the async one if vLLM runs async)."""

    def __new__(cls, vllm_config: Any = None, *args: Any, **kwargs: Any) -> Scheduler:
        if (
            cls is Scheduler
            and vllm_config is not None
            and vllm_config.scheduler_config.async_scheduling
        ):
            cls = AsyncScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with manager_class_in_vllm_scheduler(PagedKVCacheManager):
            super().__init__(*args, **kwargs)


class AsyncScheduler(Scheduler, vllm_async_scheduler.AsyncScheduler):
    """vLLM's `AsyncScheduler` on pagedkv's KV-cache manager."""
