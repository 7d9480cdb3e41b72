"""Facade layer, KV events: the per-group annotation written into each drained `BlockStored`.

The pool builds `BlockStored` without its group's spec kind and sliding window (it knows no
specs); whoever drains the events, the facade's `take_events` or the vLLM adapter's, fills them
in through `annotate_block_stored`, from per-group metadata: pagedkv's spec kinds
(`event_metadata`) or an engine's own names for them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

from pagedkv.events import BlockStored, KVCacheEvent
from pagedkv.specs import KVCacheGroupSpec, SlidingWindowSpec

# The facade's logger (`pagedkv.kv_cache_manager`), whichever of its files logs.
logger = logging.getLogger("pagedkv.kv_cache_manager")

# Per group: (spec kind, sliding window or None).
EventMetadata = tuple[tuple[str, int | None], ...]


def event_metadata(groups: Sequence[KVCacheGroupSpec]) -> EventMetadata:
    """Per group, pagedkv's spec kind and sliding window (None if none), for
    `annotate_block_stored`."""
    return tuple(
        (
            g.kv_cache_spec.kind,
            g.kv_cache_spec.sliding_window
            if isinstance(g.kv_cache_spec, SlidingWindowSpec)
            else None,
        )
        for g in groups
    )


def annotate_block_stored(events: Iterable[KVCacheEvent], metadata: EventMetadata) -> None:
    """Write its group's spec kind and sliding window into each `BlockStored` (in place); a
    group index outside `metadata` is logged and left unannotated, as the reference does."""
    for event in events:
        if type(event) is BlockStored and event.group_idx is not None:
            if 0 <= event.group_idx < len(metadata):
                event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = metadata[
                    event.group_idx
                ]
            else:
                logger.warning("KV event group %d is not in KV cache metadata", event.group_idx)
