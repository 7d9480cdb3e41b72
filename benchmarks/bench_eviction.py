"""Eviction policies on the hot path (issue 13 item 7), run by hand; prints JSON.

The serving loops of bench_core.py (decode: no eviction; shared prefix: a pool smaller than
the working set, so every admission evicts) once per policy, rounds alternating the policy
order; each op's median microseconds per call, and its ratio to `lru` (the reference's plain
free queue) measured in the same run. Per-call times are this thread's CPU time
(`time.thread_time`), so other processes on a shared machine disturb them less than wall time;
still, compare ratios.

    python benchmarks/bench_eviction.py [--rounds 3] [--scale 0.25] [--policies lru,lfu,...]

`--lru-against SRC` instead times plain LRU (no eviction argument) with the pagedkv package of
another tree (e.g. main's `src/`) against this one, in alternating child processes: the check
that the default path did not get slower.

    git archive main | tar -x -C /tmp/main && python benchmarks/bench_eviction.py \
        --lru-against /tmp/main/src
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import sys
from pathlib import Path

if len(sys.argv) > 2 and sys.argv[1] == "--child-src":
    sys.path.insert(0, sys.argv[2])  # the pagedkv tree to time, ahead of the installed one
sys.path.insert(0, str(Path(__file__).resolve().parent))

import time  # noqa: E402

import bench_core  # noqa: E402
from bench_core import run_serving  # noqa: E402

ONLINE_POLICY_NAMES = ("lru", "lfu", "s3fifo", "arc", "cost", "continuation", "hazard")
# A name with "+lookahead" adds the waiting-queue look-ahead to that policy.
DEFAULT_POLICIES = (*ONLINE_POLICY_NAMES, "lru+lookahead")


def eviction_for(name: str):
    """The manager's eviction argument for a policy name of this benchmark."""
    from pagedkv.eviction import EvictionConfig

    policy, _, feature = name.partition("+")
    if feature == "lookahead":
        return EvictionConfig(policy=policy, lookahead=True)
    return policy


OPS = ("lookup", "prefill", "decode", "free")


def scenarios(scale: float) -> dict[str, dict]:
    """bench_core's decode and shared-prefix workloads, `scale` times as many requests."""
    rng = random.Random(0)
    num_requests = max(64, int(1024 * scale))
    decode_prompts = [[rng.randrange(32000) for _ in range(1000)] for _ in range(num_requests)]
    rng = random.Random(1)
    system = [rng.randrange(32000) for _ in range(4000)]
    shared_prompts = [
        system + [rng.randrange(32000) for _ in range(1000)] for _ in range(num_requests)
    ]
    return {
        "decode": dict(prompts=decode_prompts, num_blocks=20000),
        "shared_prefix": dict(prompts=shared_prompts, num_blocks=12000),
    }


def run_child(scenario_name: str, scale: float, batched: bool) -> None:
    """In a child process: time plain LRU with whatever pagedkv is first on sys.path."""
    import pagedkv

    bench_core.perf_counter = time.thread_time
    scenario = scenarios(scale)[scenario_name]
    run = run_serving(
        num_requests=len(scenario["prompts"]),
        batch=256,
        prompts=scenario["prompts"],
        decode_steps=200,
        num_blocks=scenario["num_blocks"],
        batched=batched,
    )
    run["pagedkv"] = str(Path(pagedkv.__file__).resolve().parent)
    print(json.dumps(run))


def lru_against(other_src: str, rounds: int, scale: float, batched: bool) -> dict:
    """Plain LRU, this tree vs `other_src`, alternating child processes; medians per op."""
    here = str(Path(__file__).resolve().parents[1] / "src")
    result: dict = {}
    for name in scenarios(scale):
        samples: dict[str, dict[str, list[float]]] = {"this": {}, "other": {}}
        for round_index in range(rounds):
            order = [("this", here), ("other", other_src)]
            if round_index % 2:
                order.reverse()
            for label, src in order:
                argv = [sys.executable, __file__, "--child-src", src, name, str(scale)]
                if batched:
                    argv.append("--batched")
                out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
                run = json.loads(out)
                assert run["pagedkv"].startswith(str(Path(src).resolve())), run["pagedkv"]
                for op, value in run["us_per_call"].items():
                    samples[label].setdefault(op, []).append(value)
        medians = {k: {op: statistics.median(v) for op, v in d.items()} for k, d in samples.items()}
        result[name] = {
            op: {
                "this_us": round(medians["this"][op], 3),
                "other_us": round(medians["other"][op], 3),
                "ratio": round(medians["this"][op] / medians["other"][op], 3),
            }
            for op in medians["this"]
        }
    return result


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child-src":
        run_child(sys.argv[3], float(sys.argv[4]), "--batched" in sys.argv)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=0.25, help="fraction of bench_core's size")
    parser.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    parser.add_argument("--batched", action="store_true", help="use allocate_decode_slots")
    parser.add_argument("--lru-against", metavar="SRC", help="another tree's src/ to compare")
    args = parser.parse_args()
    if args.lru_against:
        result = lru_against(args.lru_against, args.rounds, args.scale, args.batched)
        print(json.dumps(result, indent=2))
        return 0
    policies = args.policies.split(",")
    bench_core.perf_counter = time.thread_time  # CPU time of this thread per timed region
    result: dict = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "rounds": args.rounds,
        "scale": args.scale,
    }
    for name, scenario in scenarios(args.scale).items():
        samples: dict[str, dict[str, list[float]]] = {p: {op: [] for op in OPS} for p in policies}
        hit_rates: dict[str, float] = {}
        for round_index in range(args.rounds):
            order = (
                policies[round_index % len(policies) :] + policies[: round_index % len(policies)]
            )
            for policy in order:
                run = run_serving(
                    num_requests=len(scenario["prompts"]),
                    batch=256,
                    prompts=scenario["prompts"],
                    decode_steps=200,
                    num_blocks=scenario["num_blocks"],
                    batched=args.batched,
                    eviction=eviction_for(policy),
                )
                hit_rates[policy] = run["hit_rate"]
                for op in OPS:
                    if op in run["us_per_call"]:
                        samples[policy][op].append(run["us_per_call"][op])
        medians = {
            p: {op: statistics.median(v) for op, v in ops.items() if v}
            for p, ops in samples.items()
        }
        base = medians.get("lru", {})
        result[name] = {
            p: {
                "us_per_call": {op: round(value, 3) for op, value in medians[p].items()},
                "ratio_to_lru": {
                    op: round(value / base[op], 3) for op, value in medians[p].items() if op in base
                },
                "hit_rate": hit_rates[p],
            }
            for p in policies
        }
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
