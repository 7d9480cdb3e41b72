"""Synthetic workloads: seeded determinism and the intended sharing structure."""

from __future__ import annotations

import pytest

from pagedkv import InvalidArgumentError
from pagedkv.sim.inputs.traces import OUTPUT_TOKEN_BASE
from pagedkv.sim.inputs.workloads import WORKLOADS, WorkloadParams, make_workload


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_same_seed_same_trace_other_seed_other_trace(name):
    params = WorkloadParams(num_requests=60, arrival="bursty", seed=3)
    first, second = make_workload(name, params), make_workload(name, params)
    assert first.requests == second.requests
    assert len(first.requests) == 60
    other = make_workload(name, WorkloadParams(num_requests=60, arrival="bursty", seed=4))
    assert other.requests != first.requests
    times = [r.arrival_time_s for r in first.requests]
    assert times == sorted(times)


def test_shared_prompt_requests_start_with_one_of_the_system_prompts():
    params = WorkloadParams(num_requests=50, num_system_prompts=3, system_prompt_tokens=100)
    trace = make_workload("shared-prompt", params)
    starts = {r.prompt_runs[0] for r in trace.requests}
    assert starts == {(0, 100), (100, 100), (200, 100)}
    user_runs = [r.prompt_runs[1] for r in trace.requests]
    assert len({run[0] for run in user_runs}) == 50  # every user message is fresh


def test_chat_turns_extend_the_previous_prompt_with_its_answer():
    trace = make_workload("chat", WorkloadParams(num_requests=200, turns=(3, 3)))
    by_id = {r.request_id: r for r in trace.requests}
    first, second = by_id["chat0-t0"], by_id["chat0-t1"]
    prompt = second.prompt_token_ids()
    previous = first.prompt_token_ids()
    answer = list(
        range(first.output_token_start, first.output_token_start + first.num_output_tokens)
    )
    assert prompt[: len(previous)] == previous
    assert prompt[len(previous) : len(previous) + len(answer)] == answer
    assert answer[0] >= OUTPUT_TOKEN_BASE
    assert second.arrival_time_s > first.arrival_time_s


def test_agent_steps_append_action_and_tool_result():
    trace = make_workload("agent", WorkloadParams(num_requests=100, turns=(4, 4)))
    by_id = {r.request_id: r for r in trace.requests}
    step0, step1 = by_id["agent0-s0"], by_id["agent0-s1"]
    assert step1.prompt_runs[: len(step0.prompt_runs)] == step0.prompt_runs
    assert step1.prompt_runs[len(step0.prompt_runs)] == (
        step0.output_token_start,
        step0.num_output_tokens,
    )
    # Every agent starts with the same tool definitions.
    assert by_id["agent1-s0"].prompt_runs[0] == step0.prompt_runs[0]


def test_poisson_rate_is_respected():
    trace = make_workload("shared-prompt", WorkloadParams(num_requests=2000, rate_per_s=5.0))
    assert trace.duration_s / 1999 == pytest.approx(0.2, rel=0.1)


def test_bad_parameters():
    with pytest.raises(InvalidArgumentError, match="arrival"):
        WorkloadParams(arrival="uniform")
    with pytest.raises(InvalidArgumentError, match="user_tokens"):
        WorkloadParams(user_tokens=(10, 5))
    with pytest.raises(InvalidArgumentError, match="unknown workload"):
        make_workload("poetry", WorkloadParams())
