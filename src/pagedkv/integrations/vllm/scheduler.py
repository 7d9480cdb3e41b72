"""vLLM's own schedulers, building pagedkv's manager instead of vLLM's.

`--scheduler-cls pagedkv.integrations.vllm.Scheduler` is the switch: vLLM's `Scheduler`
unchanged, except that the `KVCacheManager` its constructor builds is `PagedKVCacheManager`.
When vLLM's async scheduling is on, the same name yields the async variant, as vLLM's
default does. pagedkv's options come from `additional_config["pagedkv"]` (`options.py`), read
before vLLM's constructor runs; the scheduler tells the manager of every request entering its
waiting queue (arrival, preemption), for the look-ahead, the session policies and KV hints.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm.v1.core.sched import async_scheduler as vllm_async_scheduler
from vllm.v1.core.sched import scheduler as vllm_scheduler

from pagedkv.integrations.vllm.manager import PagedKVCacheManager
from pagedkv.integrations.vllm.options import parse_options

_SWAP_LOCK = threading.Lock()


@contextmanager
def manager_class_in_vllm_scheduler(manager_class: Any) -> Iterator[None]:
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
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        # Before anything is built: a bad option stops start-up with one line.
        options = parse_options(getattr(vllm_config, "additional_config", None))
        manager: Any = PagedKVCacheManager
        if not options.is_default:
            manager = functools.partial(PagedKVCacheManager, pagedkv_options=options)
        with manager_class_in_vllm_scheduler(manager):
            super().__init__(*args, **kwargs)

    def add_request(self, request: Any) -> None:
        is_new = request.request_id not in self.requests
        super().add_request(request)
        if is_new and self.requests.get(request.request_id) is request:
            self.kv_cache_manager.add_waiting(request)

    def _preempt_request(self, request: Any, *args: Any, **kwargs: Any) -> None:
        super()._preempt_request(request, *args, **kwargs)
        self.kv_cache_manager.add_waiting(request)


class AsyncScheduler(Scheduler, vllm_async_scheduler.AsyncScheduler):
    """vLLM's `AsyncScheduler` on pagedkv's KV-cache manager."""
