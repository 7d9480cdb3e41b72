"""pagedkv's KV-cache events as vLLM's own event types, so vLLM's publishers and metrics work.

pagedkv's events carry raw digest bytes; vLLM's carry `maybe_convert_block_hash(hash)` (the low
64 bits as an int unless `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`). Every other field is copied.
"""

from __future__ import annotations

from vllm.distributed import kv_events as vllm_events
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from pagedkv.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


def _external(block_hash: bytes | int) -> bytes | int:
    if isinstance(block_hash, int):
        return block_hash
    # vLLM types the argument as its own BlockHash NewType; wrapping would cost a call a hash.
    # (unused-ignore: where vLLM is not installed, its functions are untyped.)
    return maybe_convert_block_hash(block_hash)  # type: ignore[arg-type, unused-ignore]


def to_vllm_event(event: KVCacheEvent | vllm_events.KVCacheEvent) -> vllm_events.KVCacheEvent:
    """vLLM's event for one pagedkv event (same fields, vLLM's hash form); a vLLM event is
    returned as it is."""
    if type(event) is BlockStored:
        return vllm_events.BlockStored(
            block_hashes=[_external(h) for h in event.block_hashes],
            parent_block_hash=(
                None if event.parent_block_hash is None else _external(event.parent_block_hash)
            ),
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=event.lora_id,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=event.extra_keys,
            group_idx=event.group_idx,
            kv_cache_spec_kind=event.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=event.kv_cache_spec_sliding_window,
            locality=event.locality,
            ownership=event.ownership,
            session_id=event.session_id,
            lookahead_token_ids=event.lookahead_token_ids,
        )
    if type(event) is BlockRemoved:
        return vllm_events.BlockRemoved(
            block_hashes=[_external(h) for h in event.block_hashes],
            medium=event.medium,
            group_idx=event.group_idx,
            locality=event.locality,
            ownership=event.ownership,
        )
    if type(event) is AllBlocksCleared:
        return vllm_events.AllBlocksCleared()
    if isinstance(event, vllm_events.KVCacheEvent):
        return event  # already vLLM's (vLLM code may append its own events to the queue)
    raise TypeError(f"not a pagedkv KV-cache event: {event!r}")


def to_vllm_events(
    events: list[KVCacheEvent | vllm_events.KVCacheEvent],
) -> list[vllm_events.KVCacheEvent]:
    return [to_vllm_event(event) for event in events]
