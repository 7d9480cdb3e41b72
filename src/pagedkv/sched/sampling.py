"""Scheduler layer, sampled tokens: checking a step's sampled ids and appending them to a request.

Functions of what the scheduler passes in; `validate_sampled` changes nothing, so a bad output
leaves every request as it was. Knows nothing of queues or the KV-cache manager.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pagedkv.errors import InvalidArgumentError
from pagedkv.request import Request, RequestStatus
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput


def validate_sampled(
    output: SchedulerOutput,
    sampled_token_ids: Mapping[str, Sequence[int]],
    requests: Mapping[str, Request],
) -> list[ScheduledRequest]:
    """Return the scheduled requests still live (in `requests`, the unfinished ones); raise
    `InvalidArgumentError` if the sampled ids do not match them (see `update_from_output`)."""
    live: list[ScheduledRequest] = []
    get_tokens = sampled_token_ids.get
    num_known = 0  # keys of sampled_token_ids that name a scheduled request
    for item in output.scheduled:
        request = item.request
        request_id = request.request_id
        tokens = get_tokens(request_id)
        if tokens is not None:
            num_known += 1
        if requests.get(request_id) is not request:
            continue  # aborted after scheduling
        live.append(item)
        if item.is_prefill_chunk_complete:
            if not tokens or isinstance(tokens, (str, bytes)):
                raise InvalidArgumentError(
                    f"step {output.step_index}: request {request_id!r} completed its "
                    f"prompt chunk and needs sampled token ids, got {tokens!r}"
                )
        elif tokens:
            raise InvalidArgumentError(
                f"step {output.step_index}: request {request_id!r} is mid-prefill and "
                f"cannot take sampled token ids, got {tokens!r}"
            )
    if num_known == len(sampled_token_ids):
        return live
    unknown = set(sampled_token_ids) - {item.request.request_id for item in output.scheduled}
    if unknown:
        raise InvalidArgumentError(
            f"step {output.step_index}: sampled token ids for unscheduled requests "
            f"{sorted(unknown)!r}"
        )
    return live


def append_sampled(
    request: Request, tokens: Sequence[int], stop_ids: frozenset[int], max_model_len: int
) -> RequestStatus | None:
    """Append tokens up to the first stopping point (a stop id, `max_tokens` outputs or
    `max_model_len` tokens); return the finished status, if any."""
    max_tokens = request.max_tokens
    num_room = max_model_len - request.num_tokens
    if max_tokens is not None:
        num_room = min(num_room, max_tokens - (request.num_tokens - request.num_prompt_tokens))
    if len(tokens) == 1 and not stop_ids:
        # Hot path: one token per decode step, no stop tokens configured.
        request.append_output_token_ids(tokens[0])
        return RequestStatus.FINISHED_LENGTH_CAPPED if num_room <= 1 else None
    status = None
    num_taken = len(tokens)
    if stop_ids:
        for position, token in enumerate(tokens):
            if token in stop_ids:
                num_taken = position + 1
                status = RequestStatus.FINISHED_STOPPED
                break
    if num_taken >= num_room:
        if status is None or num_taken > num_room:
            status = RequestStatus.FINISHED_LENGTH_CAPPED
        num_taken = num_room
    if num_taken:
        request.append_output_token_ids(list(tokens[:num_taken]))
    return status
