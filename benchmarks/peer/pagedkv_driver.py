#!/usr/bin/env python3
"""Replay the peer workloads against pagedkv's KVCacheManager (counterpart of vllm_kv_driver.py).

Drives exactly the operation sequence of benchmarks/peer/vllm_kv_driver.py: the same arguments
and defaults, the same seed and RNG call order (so the same requests and sampled tokens), the
same scheduler loop and the same manager calls with the same arguments:

  every step:  manager.new_step_starts()
               running requests: allocate_slots(req, 1)          (decode)
                   on None: preempt the most recently admitted running request (free,
                   num_computed_tokens = 0, requeue at the front of the waiting queue)
               if nothing was preempted and len(running) < batch:
                   get_computed_blocks(req)
                   allocate_slots(req, num_tokens - hit, hit, hit_blocks)
                   (None -> the request keeps waiting; admission stops)
               "model step": num_computed_tokens advances, one sampled token is appended to
                   every scheduled request (Request.append_output_token_ids -> block hashing)
               a request that has had its prefill plus --decode-steps decode steps is
                   finished: manager.free(req)

Requests are `pagedkv.Request`s built with `block_hasher=make_request_block_hasher(block_size,
algorithm)`: the prompt is hashed in the constructor, each newly full block on append. Every
manager call is wrapped in time.perf_counter() and summed per method; request construction and
token appends are reported as hash_seconds. Prints one JSON line with the vLLM driver's keys
(plus `decode_step`, the decode phase's time per step, and pagedkv-specific fields).

`--batched-decode` replaces the per-request decode loop by
`KVCacheManager.allocate_decode_slots(running, start)` (one call per step, plus one more after
each preemption); the workload statistics stay identical.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
from collections import deque
from time import perf_counter

import pagedkv
from pagedkv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    Request,
    RequestStatus,
    make_request_block_hasher,
)

METHODS = (
    "new_step_starts",
    "get_computed_blocks",
    "allocate_slots_prefill",
    "allocate_slots_decode",
    "free",
)
# The vLLM driver's --hash choices, mapped to pagedkv's algorithm names.
HASH_ALGORITHMS = {
    "sha256": "sha256",
    "sha256_cbor": "sha256_cbor",
    "xxhash": "xxh3_128",
    "xxhash_cbor": None,  # the reference's CBOR-over-xxhash has no pagedkv counterpart
}
DTYPE_BYTES_FLOAT16 = 2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The vLLM driver's arguments, names and defaults unchanged, plus --batched-decode."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["decode", "shared-prefix"], default="decode")
    p.add_argument("--requests", type=int, default=1024, help="total requests")
    p.add_argument("--batch", type=int, default=256, help="max concurrent (running) requests")
    p.add_argument(
        "--prompt-len",
        type=int,
        default=1000,
        help="prompt tokens (decode) / unique suffix tokens (shared-prefix)",
    )
    p.add_argument(
        "--decode-steps",
        type=int,
        default=200,
        help="decode steps (allocate_slots(req, 1)) per request after its prefill",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=20000,
        help="KVCacheConfig.num_blocks (block 0 is the null block)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--prefix-len", type=int, default=4000, help="shared-prefix: system prompt length"
    )
    p.add_argument(
        "--num-prefixes",
        type=int,
        default=1,
        help="shared-prefix: number of distinct system prompts, chosen uniformly per request",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument(
        "--hash",
        default="sha256",
        choices=list(HASH_ALGORITHMS),
        help="prefix-cache hash algorithm (pagedkv default: sha256)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=0, help="0 = just enough for the longest request"
    )
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--no-caching", action="store_true", help="enable_caching=False")
    p.add_argument("--log-stats", action="store_true", help="KVCacheManager(log_stats=True)")
    p.add_argument("--no-gc", action="store_true", help="gc.disable() during the replay")
    p.add_argument(
        "--selftest",
        action="store_true",
        help="replay the block-id expectations of the reference's test_prefill, then exit",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="verify block tables / ref counts after every step (slow, untimed)",
    )
    p.add_argument(
        "--gc-stats",
        action="store_true",
        help="report garbage collections per generation and their total time",
    )
    p.add_argument(
        "--batched-decode",
        action="store_true",
        help="decode with one KVCacheManager.allocate_decode_slots(running) call "
        "per step (pagedkv extension; error if the manager lacks it)",
    )
    return p.parse_args(argv)


def hash_algorithm(name: str) -> str:
    algorithm = HASH_ALGORITHMS[name]
    if algorithm is None:
        raise SystemExit(f"--hash {name}: pagedkv has no counterpart of this algorithm")
    return algorithm


def build_manager(args: argparse.Namespace, max_model_len: int) -> KVCacheManager:
    """One full-attention group, as the vLLM driver builds it (float16: 2 bytes)."""
    spec = FullAttentionSpec(
        block_size=args.block_size,
        num_kv_heads=args.num_kv_heads,
        head_size=args.head_size,
        dtype_bytes=DTYPE_BYTES_FLOAT16,
    )
    config = KVCacheConfig(
        num_blocks=args.num_blocks,
        kv_cache_groups=(KVCacheGroupSpec(("model.layers.0.self_attn",), spec),),
    )
    return KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=args.block_size,
        hash_block_size=args.block_size,
        enable_caching=not args.no_caching,
        log_stats=args.log_stats,
    )


def check_state(
    manager: KVCacheManager, running: list[Request], block_size: int, usable_blocks: int
) -> None:
    """The vLLM driver's per-step checks, plus pagedkv's own `check_invariants()`."""
    manager.check_invariants()
    pool = manager.block_pool
    holders: dict[int, int] = {}
    for req in running:
        (blocks,) = manager.get_blocks(req.request_id).blocks
        need = -(-req.num_computed_tokens // block_size)
        assert len(blocks) == need, (req.request_id, len(blocks), need)
        for j, blk in enumerate(blocks):
            holders[blk.block_id] = holders.get(blk.block_id, 0) + 1
            if (j + 1) * block_size <= req.num_computed_tokens and manager.enable_caching:
                assert blk.block_hash is not None, (req.request_id, j)
                assert blk.block_hash == req.block_hashes[j], (req.request_id, j)
    for bid, n in holders.items():
        assert pool.blocks[bid].ref_cnt == n, (bid, pool.blocks[bid].ref_cnt, n)
    assert usable_blocks - pool.get_num_free_blocks() == len(holders), (
        usable_blocks - pool.get_num_free_blocks(),
        len(holders),
    )


def selftest(args: argparse.Namespace) -> int:
    """Block ids and eviction order expected by the reference's test_prefill (11 blocks)."""
    hasher = make_request_block_hasher(16, hash_algorithm(args.hash))
    small = parse_args(["--num-blocks", "11", "--block-size", "16"])
    m = build_manager(small, 8192)

    def mk(rid: str, toks: list[int]) -> Request:
        return Request(rid, toks, max_tokens=17, block_hasher=hasher)

    common = [i for i in range(3) for _ in range(16)]
    r0 = mk("0", common + [3] * 7)
    cb, n, _ = m.get_computed_blocks(r0)
    assert len(r0.block_hashes) == 3 and n == 0
    assert m.allocate_slots(r0, 55, 0, cb).get_block_ids() == ([1, 2, 3, 4],)
    r1 = mk("1", common + [3] * 5)
    cb, n, _ = m.get_computed_blocks(r1)
    assert cb.get_block_ids() == ([1, 2, 3],) and n == 48
    assert m.allocate_slots(r1, 5, 48, cb).get_block_ids() == ([5],)
    assert m.block_pool.get_num_free_blocks() == 5
    m.free(r0)
    m.free(r1)
    order = [b.block_id for b in m.block_pool.free_block_queue.get_all_free_blocks()]
    assert order == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1], order
    r2 = mk("2", common + [3] * 6)
    cb, n, _ = m.get_computed_blocks(r2)
    assert cb.get_block_ids() == ([1, 2, 3],) and n == 48
    assert m.allocate_slots(r2, 6, 48, cb).get_block_ids() == ([5],)
    m.free(r2)
    r3 = mk("3", [99] * 160)
    cb, n, _ = m.get_computed_blocks(r3)
    assert n == 0
    assert m.allocate_slots(r3, 160, 0, cb).get_block_ids() == ([5, 4, 6, 7, 8, 9, 10, 3, 2, 1],)
    assert m.block_pool.get_num_free_blocks() == 0
    m.free(r3)
    assert m.block_pool.get_num_free_blocks() == 10
    m.check_invariants()
    print(json.dumps({"selftest": "ok", "pagedkv_version": pagedkv.__version__}))
    return 0


def make_workload(args: argparse.Namespace, rng: random.Random):
    """Prompts per request and the sampled-token table, in the vLLM driver's RNG call order."""
    vocab = args.vocab
    if args.workload == "decode":
        prompt_total = args.prompt_len
        prefixes: list[list[int]] = []
    else:
        prompt_total = args.prefix_len + args.prompt_len
        prefixes = [
            [rng.randrange(vocab) for _ in range(args.prefix_len)] for _ in range(args.num_prefixes)
        ]
    req_tokens: list[list[int]] = []
    for _ in range(args.requests):
        if args.workload == "decode":
            req_tokens.append([rng.randrange(vocab) for _ in range(args.prompt_len)])
        else:
            pi = rng.randrange(args.num_prefixes)
            req_tokens.append(prefixes[pi] + [rng.randrange(vocab) for _ in range(args.prompt_len)])
    # one sampled token per scheduled step; deterministic but request-unique
    out_tok = [rng.randrange(vocab) for _ in range(4096)]
    return prompt_total, req_tokens, out_tok


class Replay:
    """The tiny synchronous scheduler of the vLLM driver, with its counters."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        rng = random.Random(args.seed)
        prompt_total, self.req_tokens, self.out_tok = make_workload(args, rng)
        self.max_model_len = args.max_model_len or (prompt_total + args.decode_steps + 1)
        self.block_hasher = make_request_block_hasher(args.block_size, hash_algorithm(args.hash))
        self.manager = build_manager(args, self.max_model_len)
        self.pool = self.manager.block_pool
        self.usable_blocks = args.num_blocks - 1  # block 0 is the null block
        if args.batched_decode and not hasattr(self.manager, "allocate_decode_slots"):
            raise SystemExit("--batched-decode: this pagedkv has no allocate_decode_slots")
        self.t_sum = dict.fromkeys(METHODS, 0.0)
        self.n_call = dict.fromkeys(METHODS, 0)
        self.hash_seconds = 0.0
        self.waiting: deque = deque(range(args.requests))  # int (not built) or Request
        self.running: list[Request] = []
        self.n_decodes: dict[str, int] = {}
        self.lookup_tokens = self.hit_tokens = 0
        self.first_prompt_tokens = self.first_hit_tokens = 0
        self.preemptions = self.admission_failures = self.steps = self.finished = 0
        self.peak_used = 0
        self.total_decode_tokens = 0
        # (running requests decoded, seconds of manager time in the decode phase) per step
        self.decode_steps_timed: list[tuple[int, float]] = []
        self.gc_stats = GCStats()
        self.num_batched_calls = 0  # allocate_decode_slots calls (timed intervals)

    # ------------------------------------------------------------------ phases

    def preempt_last(self) -> Request:
        """Preempt the most recently admitted running request, as the FCFS scheduler does."""
        victim = self.running.pop()
        t0 = perf_counter()
        self.manager.free(victim)
        self.t_sum["free"] += perf_counter() - t0
        self.n_call["free"] += 1
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def decode_sequential(self, start: int = 0) -> tuple[list[Request], bool]:
        """allocate_slots(req, 1) for running[start:]; returns (scheduled, preempted)."""
        manager = self.manager
        running = self.running
        scheduled: list[Request] = []
        preempted = False
        i = start
        blocks = None
        while i < len(running):
            req = running[i]
            while True:
                t0 = perf_counter()
                blocks = manager.allocate_slots(req, 1)
                self.t_sum["allocate_slots_decode"] += perf_counter() - t0
                self.n_call["allocate_slots_decode"] += 1
                if blocks is not None:
                    break
                victim = self.preempt_last()
                preempted = True
                if victim is req:
                    break
            if blocks is None:
                break  # req itself was preempted (it was the last one)
            scheduled.append(req)
            i += 1
        return scheduled, preempted

    def decode_batched(self) -> tuple[list[Request], bool]:
        """The decode phase through `allocate_decode_slots(running, start)`, same outcome.

        The call serves requests in order and stops at the first that does not fit, returning
        how many it served; like the sequential loop, the driver then preempts the most
        recently admitted request and calls again from the one that failed (which counts as
        one failed allocate_slots call, so call counts match the sequential replay).
        """
        manager = self.manager
        running = self.running
        preempted = False
        start = 0
        while start < len(running):
            t0 = perf_counter()
            result = manager.allocate_decode_slots(running, start)
            self.t_sum["allocate_slots_decode"] += perf_counter() - t0
            self.num_batched_calls += 1
            start += result.num_allocated
            self.n_call["allocate_slots_decode"] += result.num_allocated
            if start == len(running):
                break
            self.n_call["allocate_slots_decode"] += 1  # the request that did not fit
            failed = running[start]
            victim = self.preempt_last()
            preempted = True
            if victim is failed:
                break  # it was the last one
        return running[:start], preempted

    def admit(self) -> list[Request]:
        """Admit waiting requests while there is room; returns the prefills scheduled."""
        args = self.args
        manager = self.manager
        waiting = self.waiting
        scheduled: list[Request] = []
        while waiting and len(self.running) < args.batch:
            item = waiting[0]
            if isinstance(item, int):
                t0 = perf_counter()
                req = Request(
                    str(item),
                    self.req_tokens[item],
                    max_tokens=args.decode_steps + 1,
                    block_hasher=self.block_hasher,  # hashes the prompt here
                )
                self.hash_seconds += perf_counter() - t0
                waiting[0] = req
                first = True
            else:
                req = item
                first = False
            t0 = perf_counter()
            hit_blocks, num_hit, _ = manager.get_computed_blocks(req)
            self.t_sum["get_computed_blocks"] += perf_counter() - t0
            self.n_call["get_computed_blocks"] += 1
            num_new = req.num_tokens - num_hit
            t0 = perf_counter()
            blocks = manager.allocate_slots(req, num_new, num_hit, hit_blocks)
            self.t_sum["allocate_slots_prefill"] += perf_counter() - t0
            self.n_call["allocate_slots_prefill"] += 1
            if blocks is None:
                self.admission_failures += 1
                break
            self.lookup_tokens += req.num_tokens
            self.hit_tokens += num_hit
            if first:
                self.first_prompt_tokens += req.num_tokens
                self.first_hit_tokens += num_hit
            waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            self.running.append(req)
            self.n_decodes.setdefault(req.request_id, 0)
            scheduled.append(req)
        return scheduled

    def model_step(self, prefills: list[Request], decodes: list[Request]) -> None:
        """Advance computed tokens and append one sampled token to every scheduled request."""
        for req in prefills:
            req.num_computed_tokens = req.num_tokens
        for req in decodes:
            req.num_computed_tokens += 1
            self.n_decodes[req.request_id] += 1
        self.total_decode_tokens += len(decodes)
        out_tok = self.out_tok
        steps = self.steps
        t0 = perf_counter()
        for req in prefills:
            req.append_output_token_ids(out_tok[(steps + int(req.request_id)) & 4095])
        for req in decodes:
            req.append_output_token_ids(out_tok[(steps + int(req.request_id)) & 4095])
        self.hash_seconds += perf_counter() - t0

    def finish_done(self) -> None:
        keep = []
        for req in self.running:
            if self.n_decodes[req.request_id] >= self.args.decode_steps:
                t0 = perf_counter()
                self.manager.free(req)
                self.t_sum["free"] += perf_counter() - t0
                self.n_call["free"] += 1
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                self.finished += 1
            else:
                keep.append(req)
        self.running = keep

    def note_usage(self) -> None:
        used = self.usable_blocks - self.pool.get_num_free_blocks()
        if used > self.peak_used:
            self.peak_used = used

    # ------------------------------------------------------------------ loop

    def step(self) -> None:
        self.steps += 1
        t0 = perf_counter()
        self.manager.new_step_starts()
        self.t_sum["new_step_starts"] += perf_counter() - t0
        self.n_call["new_step_starts"] += 1

        num_running = len(self.running)
        decode_t0 = self.t_sum["allocate_slots_decode"] + self.t_sum["free"]
        if self.args.batched_decode and self.running:
            decodes, preempted = self.decode_batched()
        else:
            decodes, preempted = self.decode_sequential()
        if num_running:
            decode_t1 = self.t_sum["allocate_slots_decode"] + self.t_sum["free"]
            self.decode_steps_timed.append((num_running, decode_t1 - decode_t0))
        self.note_usage()

        prefills: list[Request] = []
        if not preempted:
            prefills = self.admit()
            self.note_usage()
        if not decodes and not prefills and not preempted and not self.running and self.waiting:
            head = self.waiting[0]
            num_tokens = len(self.req_tokens[head]) if isinstance(head, int) else head.num_tokens
            raise SystemExit(
                f"deadlock: a request of {num_tokens} tokens cannot be admitted into an empty "
                f"pool of {self.usable_blocks} blocks"
            )
        self.model_step(prefills, decodes)
        self.finish_done()
        if self.args.check:
            check_state(self.manager, self.running, self.args.block_size, self.usable_blocks)

    def run(self) -> float:
        if self.args.gc_stats:
            gc.callbacks.append(self.gc_stats.on_gc)
        if self.args.no_gc:
            gc.disable()
        wall0 = perf_counter()
        try:
            while self.waiting or self.running:
                self.step()
        except pagedkv.InvalidArgumentError as exc:
            if "max_model_len" not in str(exc):
                raise
            # The default max_model_len leaves no room for the extra token every re-admission
            # after a preemption samples; vLLM silently caps the slots there, pagedkv refuses.
            raise SystemExit(
                f"{exc}\n(a preempted request outgrew --max-model-len "
                f"{self.max_model_len}; pass a larger --max-model-len to both drivers)"
            ) from exc
        wall = perf_counter() - wall0
        if self.args.gc_stats:
            gc.callbacks.remove(self.gc_stats.on_gc)
        if self.args.no_gc:
            gc.enable()
        return wall

    # ------------------------------------------------------------------ report

    def decode_step_summary(self) -> dict:
        """Decode-phase manager time per step, over the steps that decoded a full batch."""
        full = [s for n, s in self.decode_steps_timed if n == self.args.batch]
        return {
            "batched": self.args.batched_decode,
            "running_requests": self.args.batch,
            "steps_at_full_batch": len(full),
            "us_per_step_median": round(1e6 * statistics.median(full), 3) if full else None,
            "us_per_step_mean": round(1e6 * statistics.fmean(full), 3) if full else None,
        }

    def report(self, wall: float) -> dict:
        args = self.args
        t_sum, n_call = self.t_sum, self.n_call
        final_free = self.pool.get_num_free_blocks()
        leftover = sum(len(m.req_to_blocks) for m in self.manager.coordinator.single_type_managers)
        manager_seconds = sum(t_sum.values())
        per_method = {k: _method_stats(n_call[k], t_sum[k]) for k in METHODS}
        if args.batched_decode:
            # `calls` counts requests served (as the sequential replay's calls); the timer ran
            # once per allocate_decode_slots call.
            per_method["allocate_slots_decode"]["timed_intervals"] = self.num_batched_calls
        per_method["allocate_slots"] = _method_stats(
            n_call["allocate_slots_prefill"] + n_call["allocate_slots_decode"],
            t_sum["allocate_slots_prefill"] + t_sum["allocate_slots_decode"],
        )
        total_calls = sum(n_call.values())
        first_prompt, lookups = self.first_prompt_tokens, self.lookup_tokens
        return {
            "impl": "pagedkv.KVCacheManager",
            "pagedkv_version": pagedkv.__version__,
            "python": sys.version.split()[0],
            "workload": args.workload,
            "args": vars(args),
            "max_model_len": self.max_model_len,
            "manager_seconds": round(manager_seconds, 6),
            "manager_calls": total_calls,
            "manager_calls_per_sec": (
                round(total_calls / manager_seconds, 1) if manager_seconds else None
            ),
            "per_method": per_method,
            "hash_seconds": round(self.hash_seconds, 6),
            "wall_seconds": round(wall, 6),
            "steps": self.steps,
            "finished_requests": self.finished,
            "decode_tokens": self.total_decode_tokens,
            "prompt_tokens_first_admission": first_prompt,
            "hit_tokens_first_admission": self.first_hit_tokens,
            "prefix_hit_rate": (
                round(self.first_hit_tokens / first_prompt, 6) if first_prompt else 0.0
            ),
            "lookup_tokens_all": lookups,
            "hit_tokens_all": self.hit_tokens,
            "prefix_hit_rate_all_lookups": round(self.hit_tokens / lookups, 6) if lookups else 0.0,
            "preemptions": self.preemptions,
            "admission_failures": self.admission_failures,
            "peak_used_blocks": self.peak_used,
            "peak_usage": round(self.peak_used / self.usable_blocks, 6),
            "final_free_blocks": final_free,
            "expected_free_blocks": self.usable_blocks,
            "free_check_ok": final_free == self.usable_blocks and leftover == 0,
            "decode_step": self.decode_step_summary(),
            **({"gc": self.gc_stats.summary()} if args.gc_stats else {}),
        }


class GCStats:
    """Collections per generation and the time they took (gc.callbacks), during the replay."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._t0 = 0.0

    def on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = perf_counter()
        else:
            generation = info["generation"]
            self.collections[generation] += 1
            self.seconds[generation] += perf_counter() - self._t0

    def summary(self) -> dict:
        return {
            "collections": self.collections,
            "seconds": [round(s, 6) for s in self.seconds],
            "tracked_objects_at_end": len(gc.get_objects()),
        }


def _method_stats(calls: int, seconds: float) -> dict:
    return {
        "calls": calls,
        "seconds": round(seconds, 6),
        "calls_per_sec": round(calls / seconds, 1) if seconds > 0 else None,
        "us_per_call": round(1e6 * seconds / calls, 3) if calls else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.selftest:
        return selftest(args)
    replay = Replay(args)
    wall = replay.run()
    out = replay.report(wall)
    print(json.dumps(out))
    return 0 if out["free_check_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
