"""Scheduler layer, step records: the `StepRecord` of one scheduled batch.

A pure function of the batch and the counts the scheduler passes in (the simulator's cost model
reads these records); it changes nothing.
"""

from __future__ import annotations

from pagedkv.sched.output import SchedulerOutput, StepRecord


def make_step_record(
    output: SchedulerOutput,
    num_admitted: int,
    num_hit_tokens: int,
    usage: float,
    num_running: int,
    num_waiting: int,
) -> StepRecord:
    """The record of a step's batch: its token counts by kind, the KV tokens it reads and its
    prefill attention pairs, with the admissions, hits, usage and queue sizes passed in."""
    num_prefill = num_decode = num_kv_read = num_pairs = 0
    request_ids = []
    num_tokens = []
    # Hot path: one pass over the batch for the counts and both id/token lists.
    for item in output.scheduled:
        num_computed = item.num_computed_tokens
        num_new = item.num_scheduled_tokens
        request = item.request
        request_ids.append(request.request_id)
        num_tokens.append(num_new)
        if num_new == 1 and num_computed >= request.num_prompt_tokens:
            num_decode += 1
        else:
            num_prefill += num_new
            num_pairs += num_new * num_computed + num_new * (num_new + 1) // 2
        num_kv_read += num_computed + num_new
    return StepRecord(
        step_index=output.step_index,
        scheduled_request_ids=tuple(request_ids),
        num_scheduled_tokens=tuple(num_tokens),
        num_prefill_tokens=num_prefill,
        num_decode_tokens=num_decode,
        num_kv_tokens_read=num_kv_read,
        num_prefill_attention_pairs=num_pairs,
        num_admitted=num_admitted,
        num_prefix_hit_tokens=num_hit_tokens,
        preempted_request_ids=tuple(output.preempted_request_ids),
        usage=usage,
        num_running=num_running,
        num_waiting=num_waiting,
    )
