"""Four workloads unlike the kit's, and the scheduler loop that replays them (issue 12 item 5).

Standard library only: `scenario_driver.py` runs this module in either venv with a small
adapter for pagedkv or vLLM, so both managers receive the very same call sequence from the
very same code. Everything random is drawn up front from one seeded `random.Random`; what
happens later depends only on the managers' answers, and the run records those answers
(every block id handed out, per request) so the runner can check both managers agreed.

Workloads (all at block size 16):
  chat     multi-turn chat: conversations over 8 system prompts; each turn's prompt is the
           previous turn's prompt and answer plus a new user message; 4,000 blocks, so old
           turns are evicted and the busiest steps preempt.
  gemma3   a Gemma-3-like hybrid: 1 full-attention + 5 sliding-window (1,024-token window)
           groups, 2,000-3,000-token prompts over 8 shared system prompts, 256 decode steps,
           96 running; decode dominates.
  long32k  32,768-token prompts (3 of 4 share a 24,576-token document) prefilled in
           512-token chunks under a 2,048-token step budget, then 32 decode steps.
  churn    eviction churn: short requests over 128 Zipf-chosen prefixes in a 2,000-block pool,
           32 running; nearly every allocation evicts a cached block.

The loop, once per step: `new_step_starts()`; decode (`allocate_slots(req, 1)`) every running
request whose prompt is done, in admission order; then the next prompt chunk of every running
request still prefilling (`allocate_slots(req, n)`, n within the chunk size and the step's
token budget); then, if nobody was preempted, admissions (`get_computed_blocks` +
`allocate_slots(req, n, hit, hit_blocks)`) while there is room and budget. Any failed
allocation of a running request preempts the most recently admitted one (freed,
`num_computed_tokens = 0`, first in line again). The "model step" then advances computed
tokens and appends one sampled token to every request whose scheduled tokens reached its end;
a request that did its decode steps is freed (and, in chat, its conversation's next turn
joins the queue).
"""

from __future__ import annotations

import hashlib
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

SAMPLED_TOKENS = 4096  # the sampled-token table; request r at step s gets out_tok[(s + r) % 4096]
METHODS = (
    "new_step_starts",
    "get_computed_blocks",
    "allocate_slots_prefill",  # admission: the first chunk, with the prefix hit
    "allocate_slots_chunk",  # a running request's next prompt chunk
    "allocate_slots_decode",  # one token
    "free",
)


@dataclass(frozen=True)
class Scenario:
    """One workload's shape: the KV layout, the pool, the scheduler limits."""

    name: str
    groups: tuple[int | None, ...]  # per KV-cache group: None = full attention, else a window
    num_blocks: int
    batch: int  # most running requests
    chunk_tokens: int  # most prompt tokens of one request per step
    step_budget_tokens: int  # most tokens (decode and prompt) per step
    max_model_len: int
    block_size: int = 16
    vocab: int = 32000


SCENARIOS = {
    "chat": Scenario("chat", (None,), 4000, 32, 2048, 4096, 16384),
    "gemma3": Scenario("gemma3", (None, 1024, 1024, 1024, 1024, 1024), 48000, 96, 4096, 8192, 8192),
    "long32k": Scenario("long32k", (None,), 20000, 8, 512, 2048, 36864),
    "churn": Scenario("churn", (None,), 2000, 32, 2048, 4096, 4096),
}


@dataclass
class Job:
    """A request to be: its id, prompt, decode steps, and (chat) the turns after it."""

    rid: int
    prompt: list[int]
    decode_steps: int
    next_turns: list[tuple[list[int], int]] = field(default_factory=list)


def make_jobs(name: str, seed: int, scale: float = 1.0) -> list[Job]:
    """The workload's initial queue, every random draw made here, in a fixed order."""
    rng = random.Random(seed)
    vocab = SCENARIOS[name].vocab

    def tokens(num_tokens: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(num_tokens)]

    def count(num: int) -> int:
        return max(1, int(num * scale))

    jobs: list[Job] = []
    if name == "chat":
        systems = [tokens(rng.randrange(256, 1024)) for _ in range(8)]
        for rid in range(count(160)):
            turns = [(tokens(rng.randrange(32, 384)), rng.randrange(32, 256)) for _ in range(6)]
            first_msg, first_steps = turns[0]
            jobs.append(Job(rid, rng.choice(systems) + first_msg, first_steps, turns[1:]))
    elif name == "gemma3":
        systems = [tokens(1024) for _ in range(8)]
        for rid in range(count(384)):
            prompt = rng.choice(systems) + tokens(rng.randrange(1024, 2048))
            jobs.append(Job(rid, prompt, 256))
    elif name == "long32k":
        documents = [tokens(24576) for _ in range(2)]
        for rid in range(count(24)):
            shared = rng.random() < 0.75
            prefix = rng.choice(documents) if shared else tokens(24576)
            jobs.append(Job(rid, prefix + tokens(8192), 32))
    elif name == "churn":
        prefixes = [tokens(rng.randrange(128, 768)) for _ in range(128)]
        weights = [1.0 / (rank + 1) for rank in range(len(prefixes))]
        for rid in range(count(3000)):
            (prefix,) = rng.choices(prefixes, weights)
            jobs.append(Job(rid, prefix + tokens(rng.randrange(16, 256)), rng.randrange(8, 64)))
    else:
        raise SystemExit(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    return jobs


def make_sampled_tokens(seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed + 1)
    return [rng.randrange(vocab) for _ in range(SAMPLED_TOKENS)]


class Kit:
    """What the loop needs from one library (pagedkv or vLLM); see scenario_driver.py."""

    name = "?"
    RUNNING: Any
    PREEMPTED: Any
    FINISHED: Any

    def build_manager(self, scenario: Scenario) -> Any:
        raise NotImplementedError

    def make_request(self, rid: str, prompt: list[int], max_tokens: int) -> Any:
        raise NotImplementedError

    def check(self, manager: Any) -> None:
        """Deep checks after a step (`--check`); nothing by default."""


class Run:
    """The scheduler loop over one manager, with timers and the block-id record."""

    def __init__(
        self,
        scenario: Scenario,
        kit: Kit,
        seed: int,
        scale: float = 1.0,
        batched_decode: bool = False,
        check: bool = False,
    ) -> None:
        self.scenario = scenario
        self.kit = kit
        self.check = check
        self.batched_decode = batched_decode
        self.manager = kit.build_manager(scenario)
        self.pool = self.manager.block_pool
        self.usable_blocks = scenario.num_blocks - 1
        self.out_tok = make_sampled_tokens(seed, scenario.vocab)
        self.waiting: deque = deque(make_jobs(scenario.name, seed, scale))
        self.next_rid = max(job.rid for job in self.waiting) + 1
        self.running: list[Any] = []
        self.job_of: dict[str, Job] = {}
        self.num_decoded: dict[str, int] = {}
        self.t_sum = dict.fromkeys(METHODS, 0.0)
        self.n_call = dict.fromkeys(METHODS, 0)
        self.num_batched_calls = 0
        self.hash_seconds = 0.0
        self.decode_phase: list[tuple[int, float]] = []  # (requests decoded, seconds) per step
        self.block_log: dict[str, Any] = {}  # request id -> running sha256 of its block ids
        self.stats = dict.fromkeys(
            (
                "steps",
                "finished_requests",
                "decode_tokens",
                "prompt_tokens_first_admission",
                "hit_tokens_first_admission",
                "lookup_tokens_all",
                "hit_tokens_all",
                "preemptions",
                "admission_failures",
                "peak_used_blocks",
                "turns_queued",
            ),
            0,
        )

    # ------------------------------------------------------------------ record

    def note_blocks(self, rid: str, kind: str, blocks: Any) -> None:
        """Fold the block ids a call handed out into the request's running digest."""
        log = self.block_log.get(rid)
        if log is None:
            log = self.block_log[rid] = hashlib.sha256()
        ids = "-" if blocks is None else repr(blocks.get_block_ids())
        log.update(f"{kind}{ids};".encode())

    # ------------------------------------------------------------------ phases

    def timed(self, method: str, call: Callable[..., Any], *args: Any) -> Any:
        t0 = perf_counter()
        result = call(*args)
        self.t_sum[method] += perf_counter() - t0
        self.n_call[method] += 1
        return result

    def preempt_last(self) -> Any:
        victim = self.running.pop()
        self.timed("free", self.manager.free, victim)
        self.note_blocks(victim.request_id, "P", None)
        victim.status = self.kit.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.stats["preemptions"] += 1
        return victim

    def decode_sequential(self, decoders: list[Any]) -> tuple[list[Any], bool]:
        allocate = self.manager.allocate_slots
        empty = self.manager.empty_kv_cache_blocks
        scheduled: list[Any] = []
        preempted = False
        index = 0
        while index < len(decoders):
            req = decoders[index]
            blocks = self.timed("allocate_slots_decode", allocate, req, 1)
            if blocks is not None:
                if blocks is not empty:  # only calls that handed out blocks are recorded
                    self.note_blocks(req.request_id, "d", blocks)
                scheduled.append(req)
                index += 1
                continue
            victim = self.preempt_last()
            preempted = True
            if victim is req:
                break
            if any(victim is other for other in decoders[index + 1 :]):
                decoders.remove(victim)
        return scheduled, preempted

    def decode_batched(self, decoders: list[Any]) -> tuple[list[Any], bool]:
        """The same phase through pagedkv's `allocate_decode_slots(decoders, start)`."""
        manager = self.manager
        scheduled: list[Any] = []
        preempted = False
        start = 0
        while start < len(decoders):
            t0 = perf_counter()
            result = manager.allocate_decode_slots(decoders, start)
            self.t_sum["allocate_slots_decode"] += perf_counter() - t0
            self.num_batched_calls += 1
            served = decoders[start : start + result.num_allocated]
            for req in result.requests_with_new_blocks:  # untimed, as allocate_slots returns
                self.note_blocks(req.request_id, "d", self.new_decode_blocks(req))
            scheduled.extend(served)
            self.n_call["allocate_slots_decode"] += result.num_allocated
            start += result.num_allocated
            if start == len(decoders):
                break
            self.n_call["allocate_slots_decode"] += 1  # the request that did not fit
            failed = decoders[start]
            victim = self.preempt_last()
            preempted = True
            if victim is failed:
                break
            if any(victim is other for other in decoders[start + 1 :]):
                decoders.remove(victim)
        return scheduled, preempted

    def new_decode_blocks(self, req: Any) -> Any:
        """What `allocate_slots(req, 1)` returned for a request that needed a new block: the
        last block of every group (all groups share the block size)."""
        tables = self.manager.get_blocks(req.request_id).blocks
        return type(self.manager.empty_kv_cache_blocks)(tuple([table[-1]] for table in tables))

    def prefill_chunks(self, budget: int) -> tuple[list[tuple[Any, int]], bool, int]:
        """Next prompt chunks of running requests still prefilling, in admission order."""
        allocate = self.manager.allocate_slots
        chunk = self.scenario.chunk_tokens
        scheduled: list[tuple[Any, int]] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining <= 1 and self.num_decoded.get(req.request_id, -1) >= 0:
                index += 1  # decoding (handled before)
                continue
            num_new = min(remaining, chunk, budget)
            blocks = self.timed("allocate_slots_chunk", allocate, req, num_new)
            if blocks is None:
                victim = self.preempt_last()
                preempted = True
                if victim is req:
                    break
                continue
            self.note_blocks(req.request_id, "c", blocks)
            scheduled.append((req, num_new))
            budget -= num_new
            index += 1
        return scheduled, preempted, budget

    def admit(self, budget: int) -> list[tuple[Any, int]]:
        manager = self.manager
        stats = self.stats
        scheduled: list[tuple[Any, int]] = []
        while self.waiting and len(self.running) < self.scenario.batch and budget > 0:
            item = self.waiting[0]
            first = isinstance(item, Job)
            if first:
                rid = str(item.rid)
                t0 = perf_counter()
                req = self.kit.make_request(rid, item.prompt, item.decode_steps + 1)
                self.hash_seconds += perf_counter() - t0
                self.job_of[rid] = item
                self.waiting[0] = req
            else:
                req = item
            hit_blocks, num_hit, _ = self.timed(
                "get_computed_blocks", manager.get_computed_blocks, req
            )
            num_new = min(req.num_tokens - num_hit, self.scenario.chunk_tokens, budget)
            blocks = self.timed(
                "allocate_slots_prefill", manager.allocate_slots, req, num_new, num_hit, hit_blocks
            )
            if blocks is None:
                stats["admission_failures"] += 1
                break
            self.note_blocks(req.request_id, "h", hit_blocks)
            self.note_blocks(req.request_id, "a", blocks)
            stats["lookup_tokens_all"] += req.num_tokens
            stats["hit_tokens_all"] += num_hit
            if first:
                stats["prompt_tokens_first_admission"] += req.num_tokens
                stats["hit_tokens_first_admission"] += num_hit
            self.waiting.popleft()
            req.status = self.kit.RUNNING
            req.num_computed_tokens = num_hit
            self.num_decoded[req.request_id] = -1  # prefilling
            self.running.append(req)
            scheduled.append((req, num_new))
            budget -= num_new
        return scheduled

    def model_step(self, scheduled: list[tuple[Any, int]], decodes: list[Any]) -> None:
        out_tok = self.out_tok
        steps = self.stats["steps"]
        sampling: list[Any] = []
        for req in decodes:
            req.num_computed_tokens += 1
            self.num_decoded[req.request_id] += 1
            sampling.append(req)
        for req, num_new in scheduled:
            req.num_computed_tokens += num_new
            if req.num_computed_tokens == req.num_tokens:
                self.num_decoded[req.request_id] = 0  # prompt done: decoding from now on
                sampling.append(req)
        self.stats["decode_tokens"] += len(decodes)
        t0 = perf_counter()
        for req in sampling:
            req.append_output_token_ids(out_tok[(steps + int(req.request_id)) % SAMPLED_TOKENS])
        self.hash_seconds += perf_counter() - t0

    def finish_done(self) -> None:
        keep = []
        for req in self.running:
            rid = req.request_id
            job = self.job_of[rid]
            if self.num_decoded[rid] < job.decode_steps:
                keep.append(req)
                continue
            self.timed("free", self.manager.free, req)
            self.note_blocks(rid, "F", None)
            req.status = self.kit.FINISHED
            self.stats["finished_requests"] += 1
            if job.next_turns:
                message, decode_steps = job.next_turns[0]
                prompt = list(req.all_token_ids) + message
                self.waiting.append(Job(self.next_rid, prompt, decode_steps, job.next_turns[1:]))
                self.next_rid += 1
                self.stats["turns_queued"] += 1
        self.running = keep

    def note_usage(self) -> None:
        used = self.usable_blocks - self.pool.get_num_free_blocks()
        if used > self.stats["peak_used_blocks"]:
            self.stats["peak_used_blocks"] = used

    # ------------------------------------------------------------------ loop

    def step(self) -> None:
        self.stats["steps"] += 1
        self.timed("new_step_starts", self.manager.new_step_starts)
        decoders = [r for r in self.running if self.num_decoded[r.request_id] >= 0]
        num_decoders = len(decoders)
        before = self.t_sum["allocate_slots_decode"] + self.t_sum["free"]
        if self.batched_decode and decoders:
            decodes, preempted = self.decode_batched(decoders)
        else:
            decodes, preempted = self.decode_sequential(decoders)
        if num_decoders:
            spent = self.t_sum["allocate_slots_decode"] + self.t_sum["free"] - before
            self.decode_phase.append((num_decoders, spent))
        budget = self.scenario.step_budget_tokens - len(decodes)
        scheduled, chunk_preempted, budget = self.prefill_chunks(budget)
        if chunk_preempted:
            # A victim of the prompt chunks may have decoded already this step: it is waiting
            # now, so its decode step does not happen.
            decodes = [r for r in decodes if r.status is not self.kit.PREEMPTED]
        preempted = preempted or chunk_preempted
        self.note_usage()
        if not preempted:
            scheduled += self.admit(budget)
            self.note_usage()
        if not decodes and not scheduled and not preempted and not self.running and self.waiting:
            raise SystemExit(f"{self.scenario.name}: deadlock, nothing fits an empty pool")
        self.model_step(scheduled, decodes)
        self.finish_done()
        if self.check:
            self.kit.check(self.manager)

    def run(self) -> float:
        wall0 = perf_counter()
        while self.waiting or self.running:
            self.step()
        return perf_counter() - wall0

    # ------------------------------------------------------------------ report

    def report(self, wall: float) -> dict:
        per_method = {m: method_stats(self.n_call[m], self.t_sum[m]) for m in METHODS}
        if self.batched_decode:
            per_method["allocate_slots_decode"]["timed_intervals"] = self.num_batched_calls
        alloc = [m for m in METHODS if m.startswith("allocate_slots_")]
        per_method["allocate_slots"] = method_stats(
            sum(self.n_call[m] for m in alloc), sum(self.t_sum[m] for m in alloc)
        )
        stats = dict(self.stats)
        first_prompt = stats["prompt_tokens_first_admission"]
        stats["prefix_hit_rate"] = (
            round(stats["hit_tokens_first_admission"] / first_prompt, 6) if first_prompt else 0.0
        )
        stats["max_model_len"] = self.scenario.max_model_len
        final_free = self.pool.get_num_free_blocks()
        stats["free_check_ok"] = final_free == self.usable_blocks
        free_order = hashlib.sha256(
            repr([b.block_id for b in self.pool.free_block_queue.get_all_free_blocks()]).encode()
        )
        request_digests = {rid: log.hexdigest()[:16] for rid, log in self.block_log.items()}
        full = [s for n, s in self.decode_phase if n == self.scenario.batch]
        decode_step = {
            "batched": self.batched_decode,
            "running_requests": self.scenario.batch,
            "steps_at_full_batch": len(full),
            "us_per_step_mean": round(1e6 * statistics.fmean(full), 3) if full else None,
            "us_per_step_median": round(1e6 * statistics.median(full), 3) if full else None,
        }
        return {
            "impl": self.kit.name,
            "workload": self.scenario.name,
            "scenario": self.scenario.__dict__,
            "manager_seconds": round(sum(self.t_sum.values()), 6),
            "per_method": per_method,
            "hash_seconds": round(self.hash_seconds, 6),
            "wall_seconds": round(wall, 6),
            **stats,
            "decode_step": decode_step,
            "block_ids_digest": hashlib.sha256(
                repr(sorted(request_digests.items())).encode()
            ).hexdigest()[:16],
            "free_queue_digest": free_order.hexdigest()[:16],
            "request_block_digests": request_digests,
        }


def method_stats(calls: int, seconds: float) -> dict:
    return {
        "calls": calls,
        "seconds": round(seconds, 6),
        "us_per_call": round(1e6 * seconds / calls, 3) if calls else None,
    }
