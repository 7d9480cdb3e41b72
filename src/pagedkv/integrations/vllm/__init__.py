"""vLLM integration (extra `[vllm]`, vLLM 0.33): vLLM's own scheduler on pagedkv's manager.

- `PagedKVCacheManager`: vLLM 0.33's `KVCacheManager` interface, answered by pagedkv.
- `Scheduler` (and `AsyncScheduler`): vLLM's schedulers building it; switch with
  `--scheduler-cls pagedkv.integrations.vllm.Scheduler`.
- `pytest_plugin`: runs vLLM's own scheduler tests on it.

See docs/vllm.md for what is supported.
"""

from __future__ import annotations

import warnings

import vllm

from pagedkv.integrations.vllm.manager import PagedKVCacheManager
from pagedkv.integrations.vllm.scheduler import AsyncScheduler, Scheduler

SUPPORTED_VLLM = "0.33"

if not vllm.__version__.startswith(SUPPORTED_VLLM + "."):
    warnings.warn(
        f"pagedkv.integrations.vllm is checked against vLLM {SUPPORTED_VLLM}.x; this is vLLM "
        f"{vllm.__version__} (see docs/vllm.md: how a new release is checked)",
        stacklevel=2,
    )

__all__ = ["AsyncScheduler", "PagedKVCacheManager", "Scheduler", "SUPPORTED_VLLM"]
