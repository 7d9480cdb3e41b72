"""Simulator layer: seeded synthetic workloads (shared system prompt, multi-turn chat, agent
tool loops) with Poisson or bursty arrivals.

Each generator returns a `Trace` whose prompts are runs of token ids: fresh text gets fresh
ids, repeated text (a system prompt, a conversation's history, a previous answer) reuses the
same ids, so the manager sees exactly the intended sharing. Same arguments, same trace.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.inputs.traces import OUTPUT_TOKEN_BASE, TokenRun, Trace, TraceRequest

ARRIVAL_PROCESSES = ("poisson", "bursty")


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    """Knobs shared by every generator; token ranges are inclusive `(low, high)` uniforms.

    `arrival` is `poisson` (exponential gaps, mean `1 / rate_per_s`) or `bursty` (gamma gaps
    with the same mean and coefficient of variation `burstiness`; 1.0 would be Poisson).
    For chat and agents, `rate_per_s` is the rate at which sessions start; later turns follow
    their predecessor after an exponential think time of mean `think_time_s`.
    """

    num_requests: int = 400
    rate_per_s: float = 2.0
    arrival: str = "poisson"
    burstiness: float = 4.0
    seed: int = 0
    system_prompt_tokens: int = 2048
    num_system_prompts: int = 4
    user_tokens: tuple[int, int] = (64, 1024)
    output_tokens: tuple[int, int] = (32, 512)
    turns: tuple[int, int] = (2, 8)
    tool_output_tokens: tuple[int, int] = (128, 2048)
    think_time_s: float = 10.0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise InvalidArgumentError(f"num_requests must be >= 1, got {self.num_requests}")
        if not self.rate_per_s > 0:
            raise InvalidArgumentError(f"rate_per_s must be > 0, got {self.rate_per_s}")
        if self.arrival not in ARRIVAL_PROCESSES:
            raise InvalidArgumentError(
                f"arrival must be one of {ARRIVAL_PROCESSES}, got {self.arrival!r}"
            )
        if not self.burstiness > 0:
            raise InvalidArgumentError(f"burstiness must be > 0, got {self.burstiness}")
        for name in ("user_tokens", "output_tokens", "turns", "tool_output_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise InvalidArgumentError(
                    f"{name} must satisfy 1 <= low <= high, got {(low, high)}"
                )


class _Generator:
    """Fresh token ids and seeded draws for one workload."""

    def __init__(self, params: WorkloadParams) -> None:
        self.params = params
        self.rng = random.Random(params.seed)
        self.next_token_id = 0
        self.next_output_id = OUTPUT_TOKEN_BASE
        self.clock_s = 0.0

    def fresh(self, num_tokens: int) -> TokenRun:
        run = (self.next_token_id, num_tokens)
        self.next_token_id += num_tokens
        return run

    def fresh_output(self, num_tokens: int) -> int:
        start = self.next_output_id
        self.next_output_id += num_tokens
        return start

    def draw(self, bounds: tuple[int, int]) -> int:
        return self.rng.randint(bounds[0], bounds[1])

    def next_arrival_s(self) -> float:
        """Advance the session-start clock by one inter-arrival gap."""
        params = self.params
        mean = 1.0 / params.rate_per_s
        if params.arrival == "poisson":
            gap = self.rng.expovariate(params.rate_per_s)
        else:
            shape = 1.0 / params.burstiness**2
            gap = self.rng.gammavariate(shape, mean / shape)
        self.clock_s += gap
        return self.clock_s

    def think_time_s(self) -> float:
        return self.rng.expovariate(1.0 / self.params.think_time_s)


def _request(
    request_id: str, arrival_s: float, runs: list[TokenRun], num_output: int, output_start: int
) -> TraceRequest:
    return TraceRequest(
        request_id=request_id,
        arrival_time_s=arrival_s,
        num_prompt_tokens=sum(num_tokens for _, num_tokens in runs),
        num_output_tokens=num_output,
        prompt_runs=tuple(runs),
        output_token_start=output_start,
    )


def shared_prompt_workload(params: WorkloadParams) -> list[TraceRequest]:
    """Independent requests, each a system prompt (one of `num_system_prompts`, uniform)
    followed by a fresh user message."""
    gen = _Generator(params)
    systems = [gen.fresh(params.system_prompt_tokens) for _ in range(params.num_system_prompts)]
    requests = []
    for index in range(params.num_requests):
        system = systems[gen.rng.randrange(len(systems))]
        runs = [system, gen.fresh(gen.draw(params.user_tokens))]
        num_output = gen.draw(params.output_tokens)
        requests.append(
            _request(
                f"shared-{index}",
                gen.next_arrival_s(),
                runs,
                num_output,
                gen.fresh_output(num_output),
            )
        )
    return requests


def chat_workload(params: WorkloadParams) -> list[TraceRequest]:
    """Conversations: turn k's prompt is the system prompt, every earlier user message and
    answer, and a fresh user message; the answers are the ids the simulator generates."""
    gen = _Generator(params)
    system = gen.fresh(params.system_prompt_tokens)
    requests: list[TraceRequest] = []
    conversation = 0
    while len(requests) < params.num_requests:
        arrival_s = gen.next_arrival_s()
        history = [system]
        for turn in range(gen.draw(params.turns)):
            history.append(gen.fresh(gen.draw(params.user_tokens)))
            num_output = gen.draw(params.output_tokens)
            output_start = gen.fresh_output(num_output)
            requests.append(
                _request(
                    f"chat{conversation}-t{turn}", arrival_s, history, num_output, output_start
                )
            )
            history.append((output_start, num_output))
            arrival_s += gen.think_time_s()
        conversation += 1
    return requests


def agent_workload(params: WorkloadParams) -> list[TraceRequest]:
    """Agent loops: a long shared tool-definition prompt, a task, then per iteration the
    previous action (the generated output) and a fresh tool result appended."""
    gen = _Generator(params)
    tools = gen.fresh(params.system_prompt_tokens * 2)
    requests: list[TraceRequest] = []
    agent = 0
    while len(requests) < params.num_requests:
        arrival_s = gen.next_arrival_s()
        context = [tools, gen.fresh(gen.draw(params.user_tokens))]
        for step in range(gen.draw(params.turns)):
            num_output = gen.draw(params.output_tokens)
            output_start = gen.fresh_output(num_output)
            requests.append(
                _request(f"agent{agent}-s{step}", arrival_s, context, num_output, output_start)
            )
            context = [
                *context,
                (output_start, num_output),
                gen.fresh(gen.draw(params.tool_output_tokens)),
            ]
            arrival_s += gen.think_time_s()
        agent += 1
    return requests


WORKLOADS: dict[str, Callable[[WorkloadParams], list[TraceRequest]]] = {
    "shared-prompt": shared_prompt_workload,
    "chat": chat_workload,
    "agent": agent_workload,
}


def make_workload(name: str, params: WorkloadParams) -> Trace:
    """Generate the named workload: the first `num_requests` requests by arrival time.

    Arrivals are open-loop: a follow-up turn arrives after its think time whether or not the
    simulated server has answered the previous one.
    """
    generator = WORKLOADS.get(name)
    if generator is None:
        raise InvalidArgumentError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    requests = generator(params)
    ordered = sorted(requests, key=lambda request: request.arrival_time_s)[: params.num_requests]
    # Output ids were assigned at generation, because later turns repeat them in their prompts.
    return Trace(name, tuple(ordered), f"synthetic:{name}(seed={params.seed})")
