"""vLLM requests seen as pagedkv requests: one external view per vLLM `Request`, no token copy.

The view shares the vLLM request's token list and `block_hashes` list (vLLM's hashes are used as
opaque keys) and copies the few counters pagedkv reads before every manager call. It is stored on
the vLLM request itself, so it lives and dies with it.
"""

from __future__ import annotations

from typing import Any, cast

from vllm.v1.request import Request as VllmRequest
from vllm.v1.request import RequestStatus as VllmStatus

from pagedkv.block import BlockHash
from pagedkv.request import MultiModalFeature, Request, RequestStatus

VIEW_ATTRIBUTE = "_pagedkv_request"

# Every waiting flavour (grammar, remote KV, streaming input) is WAITING to the manager: such a
# request holds no running slot, so the watermark applies to it.
_STATUS_TO_PAGEDKV: dict[VllmStatus, RequestStatus] = {
    VllmStatus.WAITING: RequestStatus.WAITING,
    VllmStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR: RequestStatus.WAITING,
    VllmStatus.WAITING_FOR_REMOTE_KVS: RequestStatus.WAITING,
    VllmStatus.WAITING_FOR_STREAMING_REQ: RequestStatus.WAITING,
    VllmStatus.RUNNING: RequestStatus.RUNNING,
    VllmStatus.PREEMPTED: RequestStatus.PREEMPTED,
}
# Every finished status maps to one pagedkv finished status (the manager only asks "finished?").
for _status in VllmStatus:
    if VllmStatus.is_finished(_status):
        _STATUS_TO_PAGEDKV[_status] = RequestStatus.FINISHED_STOPPED


_VLLM_RUNNING = VllmStatus.RUNNING
_RUNNING = RequestStatus.RUNNING


def map_status(status: VllmStatus) -> RequestStatus:
    """pagedkv's status for a vLLM status (an unknown future status counts as waiting)."""
    return _STATUS_TO_PAGEDKV.get(status, RequestStatus.WAITING)


def _mm_features(request: VllmRequest) -> tuple[MultiModalFeature, ...]:
    return tuple(
        MultiModalFeature(f.identifier, f.mm_position.offset, f.mm_position.length)
        for f in request.mm_features
    )


def _prompt_embeds(request: VllmRequest) -> memoryview | None:
    """The prompt embeddings as rows of raw bytes (what vLLM hashes), or None."""
    embeds = request.prompt_embeds
    if embeds is None:
        return None
    from vllm.v1.utils import tensor_data

    raw = memoryview(tensor_data(embeds.contiguous())).cast("B")
    num_rows = embeds.shape[0]
    return raw.cast("B", (num_rows, raw.nbytes // num_rows))


def make_view(request: VllmRequest, hash_block_size: int) -> Request:
    """Build (and attach to `request`) the pagedkv view of a vLLM request."""
    tokens: Any = getattr(request, "_all_token_ids", None)
    if not isinstance(tokens, list):
        tokens = request.all_token_ids  # a read-only list wrapper: slicing still works
    view = Request.external(
        request.request_id,
        tokens,
        cast("list[BlockHash]", request.block_hashes),  # both are digest bytes
        hash_block_size,
        num_prompt_tokens=request.num_prompt_tokens,
        # vLLM's LoRARequest has the `name`, `path` and `adapter_id` pagedkv reads.
        lora_request=cast(Any, request.lora_request),
        cache_salt=request.cache_salt,
        mm_features=_mm_features(request),
        prompt_embeds=_prompt_embeds(request),
        skip_reading_prefix_cache=request.skip_reading_prefix_cache,
        session_id=request.session_id,
    )
    setattr(request, VIEW_ATTRIBUTE, view)
    return view


def sync_view(request: VllmRequest, hash_block_size: int) -> Request:
    """The request's view with its counters copied from the vLLM request."""
    # Hot path: called on every manager call that takes a request; a few attribute copies.
    view = request.__dict__.get(VIEW_ATTRIBUTE)
    if view is None:
        view = make_view(request, hash_block_size)
    elif request.mm_features and len(view.mm_features) != len(request.mm_features):
        # A streaming session appended multimodal items. Updated in place: the core knows the
        # request by this view object.
        view.mm_features = _mm_features(request)
        view.has_extra_keys = True
    view.num_tokens = len(view.all_token_ids)
    view.num_prompt_tokens = request.num_prompt_tokens
    view.num_computed_tokens = request.num_computed_tokens
    view.num_in_flight_tokens = request.num_in_flight_tokens
    view.num_preemptions = request.num_preemptions
    view.shared_prefix_boundary = request.shared_prefix_boundary
    status = request.status
    # Hot path: an identity check for the common status instead of a mapping lookup.
    view.status = (
        _RUNNING
        if status is _VLLM_RUNNING
        else _STATUS_TO_PAGEDKV.get(status, RequestStatus.WAITING)
    )
    return view


def existing_view(request: VllmRequest) -> Request | None:
    """The view attached to the request, if the manager has seen it."""
    return request.__dict__.get(VIEW_ATTRIBUTE)
