"""Simulator layer: how serve mode drives vLLM's scheduler (`vllm_serve`), without vLLM.

The options and the settings refused are checked here, before vLLM (seconds to import) is
loaded, so a bad command fails at once; `vllm_serve` imports this, never the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import ConfigError
from pagedkv.sim.serve import ServeConfig

KV_MANAGERS = ("pagedkv", "vllm")


@dataclass(frozen=True)
class VllmOptions:
    """How vLLM's scheduler runs: whose KV-cache manager, and async scheduling."""

    kv_manager: str = "pagedkv"
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.kv_manager not in KV_MANAGERS:
            raise ConfigError(f"kv_manager must be one of {KV_MANAGERS}, got {self.kv_manager!r}")


def check_supported(config: ServeConfig) -> None:
    """Refuse the serve settings vLLM's scheduler is not driven with here (one line each)."""
    refused = {
        "a real model's KV-cache groups (--model)": config.kv_cache_config is not None,
        "eviction policies other than lru (--eviction)": config.eviction != "lru",
        "a host-memory tier (--host-capacity)": config.host_num_blocks > 0,
        "KV-cache events (clusters)": config.enable_kv_cache_events,
        "async caching (--async-caching; vLLM's counterpart is --async-scheduling)": (
            config.scheduler.async_caching
        ),
        "reserve_full_prompt=False": not config.scheduler.reserve_full_prompt,
        "stop token ids": bool(config.scheduler.stop_token_ids),
    }
    for what, is_set in refused.items():
        if is_set:
            raise ConfigError(f"--scheduler vllm does not support {what}")
    if not config.watermark < 1:
        raise ConfigError(f"vLLM's watermark must be < 1, got {config.watermark!r}")
