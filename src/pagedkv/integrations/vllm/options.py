"""pagedkv's options inside vLLM: `VllmConfig.additional_config["pagedkv"]`, read once at start-up.

`--additional-config '{"pagedkv": {"eviction": "hazard", "lookahead": true}}'` chooses the
eviction policy, the waiting-queue look-ahead and retention (which KV hints need). An unknown
key or a bad value raises `ConfigError` with one line naming it, before vLLM builds anything.
Knows nothing of vLLM's classes: it reads a plain mapping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pagedkv.errors import ConfigError
from pagedkv.eviction import ONLINE_POLICY_NAMES, EvictionConfig

ADDITIONAL_CONFIG_KEY = "pagedkv"
OPTION_NAMES = ("eviction", "lookahead", "retention", "max_retained_fraction", "host_num_blocks")


@dataclass(frozen=True)
class PagedKVOptions:
    """pagedkv's options in vLLM; the defaults keep vLLM's own LRU order bit for bit.

    `eviction`: an online policy name; `lookahead`: evict last the blocks that waiting
    requests will hit (the Scheduler subclass registers each request at arrival);
    `retention`: honour retention hints (KV hints of type `pagedkv.retention`), at most
    `max_retained_fraction` of the blocks raised at once; `host_num_blocks`: 0 only (pagedkv's
    host tier needs a scheduler that loads blocks back, which vLLM's does through connectors).
    """

    eviction: str = "lru"
    lookahead: bool = False
    retention: bool = False
    max_retained_fraction: float = 0.5
    host_num_blocks: int = 0

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_OPTIONS

    def eviction_config(self) -> EvictionConfig:
        return EvictionConfig(
            policy=self.eviction,
            lookahead=self.lookahead,
            retention=self.retention,
            max_retained_fraction=self.max_retained_fraction,
        )


DEFAULT_OPTIONS = PagedKVOptions()


def _fail(problem: str) -> ConfigError:
    return ConfigError(f'additional_config["{ADDITIONAL_CONFIG_KEY}"]: {problem}')


def _flag(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise _fail(f"{name}={value!r} must be true or false")
    return value


def parse_options(additional_config: object) -> PagedKVOptions:
    """pagedkv's options from vLLM's `additional_config` (absent: the defaults)."""
    if not isinstance(additional_config, Mapping):
        return DEFAULT_OPTIONS  # vLLM also takes a hashable object of its own: not ours
    section = additional_config.get(ADDITIONAL_CONFIG_KEY)
    if section is None:
        return DEFAULT_OPTIONS
    if not isinstance(section, Mapping):
        raise _fail(f"expected an object of options, got {section!r}")
    unknown = [key for key in section if key not in OPTION_NAMES]
    if unknown:
        raise _fail(f"unknown option {unknown[0]!r}; known: {', '.join(OPTION_NAMES)}")
    eviction = section.get("eviction", "lru")
    if eviction not in ONLINE_POLICY_NAMES:
        raise _fail(f"eviction={eviction!r}; choose one of {', '.join(ONLINE_POLICY_NAMES)}")
    fraction = section.get("max_retained_fraction", 0.5)
    if (
        isinstance(fraction, bool)
        or not isinstance(fraction, (int, float))
        or not (math.isfinite(fraction) and 0.0 <= fraction <= 1.0)
    ):
        raise _fail(f"max_retained_fraction={fraction!r} must be a number in [0, 1]")
    host_num_blocks = section.get("host_num_blocks", 0)
    if type(host_num_blocks) is not int or host_num_blocks < 0:
        raise _fail(f"host_num_blocks={host_num_blocks!r} must be an int >= 0")
    if host_num_blocks:
        raise _fail(
            f"host_num_blocks={host_num_blocks}: pagedkv's host tier needs a scheduler that "
            "loads blocks back, and vLLM's loads through KV connectors; use a connector "
            "(vLLM's CPU offloading, LMCache) instead"
        )
    return PagedKVOptions(
        eviction=eviction,
        lookahead=_flag("lookahead", section.get("lookahead", False)),
        retention=_flag("retention", section.get("retention", False)),
        max_retained_fraction=float(fraction),
        host_num_blocks=host_num_blocks,
    )
