#!/usr/bin/env python3
"""Run pagedkv and vLLM's KVCacheManager side by side on the issue-7 workloads; print ratios.

Each repetition runs, for every workload, vLLM's driver (benchmarks/peer/vllm/vllm_kv_driver.py
under the peer venv's python) and pagedkv's driver (this interpreter, or --pagedkv-python) as
child processes of this runner, alternating which goes first. Both replay the identical
operation sequence; the runner asserts that their workload statistics (steps, hits,
preemptions, admission failures, peak usage, calls per method) are identical, which is what
proves it. Medians over --reps repetitions go into the table and into a JSON file under
benchmarks/results/.

  python benchmarks/peer/run_compare.py --vllm-python .peer-venv/bin/python

The issue-12 workloads (chat, gemma3, long32k, churn: `--workloads scenarios`) run through
scenario_driver.py, one loop with a pagedkv and a vLLM adapter; for them the runner also
checks that both managers handed every request the same block ids and left the same free-queue
order (digests per request, see scenarios.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PAGEDKV_DRIVER = HERE / "pagedkv_driver.py"
CPU_CLOCK = HERE / "cpu_clock.py"
VLLM_DRIVER = HERE / "vllm" / "vllm_kv_driver.py"
SCENARIO_DRIVER = HERE / "scenario_driver.py"
DEFAULT_VLLM_PYTHON = os.environ.get("PEER_PYTHON", str(REPO / ".peer-venv" / "bin" / "python"))

COMMON = [
    "--requests",
    "1024",
    "--batch",
    "256",
    "--prompt-len",
    "1000",
    "--decode-steps",
    "200",
    "--num-blocks",
    "20000",
    "--seed",
    "0",
]
WORKLOADS: dict[str, list[str]] = {
    "decode": ["--workload", "decode", *COMMON],
    "shared1": [
        "--workload",
        "shared-prefix",
        "--prefix-len",
        "4000",
        "--num-prefixes",
        "1",
        *COMMON,
    ],
    "shared8": [
        "--workload",
        "shared-prefix",
        "--prefix-len",
        "4000",
        "--num-prefixes",
        "8",
        *COMMON,
    ],
    # 1,024 running requests: the second batched-decode figure.
    "decode1024": [
        "--workload",
        "decode",
        "--requests",
        "2048",
        "--batch",
        "1024",
        "--prompt-len",
        "1000",
        "--decode-steps",
        "200",
        "--num-blocks",
        "80000",
        "--seed",
        "0",
    ],
    # Not in the default set: 32 system prompts in 8,000 blocks, so eviction and admission
    # failures dominate (hit rate 0.54, 49 preemptions, 2,765 failed admissions).
    "evict32": [
        "--workload",
        "shared-prefix",
        "--prefix-len",
        "4000",
        "--num-prefixes",
        "32",
        "--requests",
        "512",
        "--batch",
        "64",
        "--prompt-len",
        "1000",
        "--decode-steps",
        "200",
        "--num-blocks",
        "8000",
        "--seed",
        "0",
    ],
}
# The issue-12 workloads, defined in scenarios.py and replayed by scenario_driver.py.
SCENARIO_WORKLOADS = ("chat", "gemma3", "long32k", "churn")
PRESETS = {
    "kit": "decode,shared1,shared8,decode1024",
    "scenarios": ",".join(SCENARIO_WORKLOADS),
}
QUICK_SCALE = {"--requests": 96, "--batch": 32, "--decode-steps": 40}  # --quick: a smoke run
QUICK_SCENARIO_SCALE = "0.15"
# Every re-admission after a preemption samples one token that is not a decode step, so a
# preempted request ends longer than the drivers' default max_model_len (vLLM then silently
# caps its slots; pagedkv raises). Both drivers get this much headroom instead.
MAX_MODEL_LEN_HEADROOM = 256

# Deterministic outcomes of the replay: equal in both drivers iff the call sequences match.
WORKLOAD_STATS = (
    "steps",
    "finished_requests",
    "decode_tokens",
    "prompt_tokens_first_admission",
    "hit_tokens_first_admission",
    "prefix_hit_rate",
    "lookup_tokens_all",
    "hit_tokens_all",
    "preemptions",
    "admission_failures",
    "peak_used_blocks",
    "max_model_len",
    "free_check_ok",
)
METHODS = (
    "get_computed_blocks",
    "allocate_slots_prefill",
    "allocate_slots_chunk",
    "allocate_slots_decode",
    "free",
    "new_step_starts",
    "allocate_slots",
)
# What must match in the scenario runs, besides the statistics: the block ids of every request
# and the final eviction order.
SCENARIO_STATS = (
    "steps",
    "finished_requests",
    "decode_tokens",
    "prompt_tokens_first_admission",
    "hit_tokens_first_admission",
    "prefix_hit_rate",
    "lookup_tokens_all",
    "hit_tokens_all",
    "preemptions",
    "admission_failures",
    "peak_used_blocks",
    "turns_queued",
    "free_check_ok",
    "block_ids_digest",
    "free_queue_digest",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3, help="repetitions per driver and workload")
    p.add_argument(
        "--workloads",
        default="kit",
        help=f"comma-separated subset of {','.join([*WORKLOADS, *SCENARIO_WORKLOADS])}"
        f", or a preset: {', '.join(f'{k} = {v}' for k, v in PRESETS.items())}",
    )
    p.add_argument(
        "--hash",
        default="sha256",
        choices=["sha256", "sha256_cbor"],
        help="prefix-cache hash algorithm of both libraries",
    )
    p.add_argument(
        "--vllm-python",
        default=DEFAULT_VLLM_PYTHON,
        help="python of the peer venv (setup_venv.sh); env PEER_PYTHON",
    )
    p.add_argument("--pagedkv-python", default=sys.executable)
    p.add_argument(
        "--no-batched",
        action="store_true",
        help="skip the pagedkv --batched-decode runs even if the API exists",
    )
    p.add_argument("--quick", action="store_true", help="smaller workloads (smoke test)")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: the drivers' perf_counter; cpu: thread CPU time (cpu_clock.py), "
        "its per-interval cost subtracted; steadier on a busy machine",
    )
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/...)")
    return p.parse_args(argv)


def workload_args(name: str, quick: bool) -> list[str]:
    if name in SCENARIO_WORKLOADS:
        return ["--workload", name, *(["--scale", QUICK_SCENARIO_SCALE] if quick else [])]
    argv = list(WORKLOADS[name])
    if quick:
        for flag, value in QUICK_SCALE.items():
            argv[argv.index(flag) + 1] = str(value)
    values = dict(zip(argv[::2], argv[1::2], strict=True))
    prompt_total = int(values["--prompt-len"])
    if values["--workload"] == "shared-prefix":
        prompt_total += int(values["--prefix-len"])
    max_model_len = prompt_total + int(values["--decode-steps"]) + 1 + MAX_MODEL_LEN_HEADROOM
    return [*argv, "--max-model-len", str(max_model_len)]


def run_driver(
    python: str, driver: Path, argv: list[str], env: dict[str, str], clock: str = "wall"
) -> dict:
    """Run one driver; its JSON line, plus the child's wall and CPU seconds (contention)."""
    cmd = [python, str(driver), *argv]
    if clock == "cpu":
        cmd.insert(1, str(CPU_CLOCK))
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    # CPU share below 1.0 means the child waited for a core: other load inflated its timers.
    result["runner"] = {
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "cpu_share": round(cpu / wall, 3),
    }
    if "clock" in result:
        subtract_clock_overhead(result)
    return result


def subtract_clock_overhead(result: dict) -> None:
    """Take the CPU clock's own cost (one per timed interval) out of the manager timings."""
    overhead = result["clock"]["overhead_us"] * 1e-6
    per_method = result["per_method"]
    for method, stats in per_method.items():
        if method == "allocate_slots":
            continue
        intervals = stats.get("timed_intervals", stats["calls"])
        stats["seconds"] = max(stats["seconds"] - intervals * overhead, 0.0)
        stats["us_per_call"] = 1e6 * stats["seconds"] / stats["calls"] if stats["calls"] else None
    merged = per_method["allocate_slots"]
    merged["seconds"] = sum(
        per_method[m]["seconds"] for m in per_method if m.startswith("allocate_slots_")
    )
    merged["us_per_call"] = 1e6 * merged["seconds"] / merged["calls"] if merged["calls"] else None
    result["manager_seconds"] = sum(
        stats["seconds"] for method, stats in per_method.items() if method != "allocate_slots"
    )
    step = result.get("decode_step")
    if step and step["us_per_step_mean"] is not None:
        # One timed interval per request per step, or one per step when batched.
        intervals = 1 if step["batched"] else step["running_requests"]
        step["us_per_step_mean"] -= intervals * result["clock"]["overhead_us"]
        step["us_per_step_median"] -= intervals * result["clock"]["overhead_us"]


def pagedkv_env() -> dict[str, str]:
    """This checkout's sources first, so the runner measures the tree it sits in."""
    env = dict(os.environ)
    src = str(REPO / "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def has_batched_decode(python: str, env: dict[str, str]) -> bool:
    code = "import pagedkv; print(hasattr(pagedkv.KVCacheManager, 'allocate_decode_slots'))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip() == "True"


def assert_same_workload(name: str, a: dict, b: dict, label: str) -> None:
    stats = SCENARIO_STATS if name in SCENARIO_WORKLOADS else WORKLOAD_STATS
    diffs = {k: (a[k], b[k]) for k in stats if a[k] != b[k]}
    for method in METHODS[:-1]:
        ca = a["per_method"].get(method, {}).get("calls")
        cb = b["per_method"].get(method, {}).get("calls")
        if ca != cb:
            diffs[f"{method}.calls"] = (ca, cb)
    if "request_block_digests" in a:
        da, db = a["request_block_digests"], b["request_block_digests"]
        differing = sorted(
            (rid for rid in da.keys() | db.keys() if da.get(rid) != db.get(rid)), key=int
        )
        if differing:
            diffs["requests_with_other_block_ids"] = (len(differing), differing[:5])
    if diffs:
        raise SystemExit(f"{name}: {label} replayed a different workload: {diffs}")
    if not a["free_check_ok"]:
        raise SystemExit(f"{name}: final free check failed")


def pick_of(runs: list[dict], path: tuple[str, ...], pick) -> float | None:
    values = []
    for run in runs:
        value = run
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            values.append(value)
    return pick(values) if values else None


def summarize(runs: dict[str, list[dict]], pick=statistics.median) -> dict:
    """Per implementation the `pick` (median, or min for best-of) of each metric; ratios."""
    out: dict = {}
    for impl, impl_runs in runs.items():
        med = {m: pick_of(impl_runs, ("per_method", m, "us_per_call"), pick) for m in METHODS}
        med["prefill_pair"] = pick(
            (r["per_method"]["get_computed_blocks"]["us_per_call"] or 0.0)
            + (r["per_method"]["allocate_slots_prefill"]["us_per_call"] or 0.0)
            for r in impl_runs
        )
        med["manager_seconds"] = pick_of(impl_runs, ("manager_seconds",), pick)
        med["hash_seconds"] = pick_of(impl_runs, ("hash_seconds",), pick)
        med["manager_plus_hash_seconds"] = pick(
            r["manager_seconds"] + r["hash_seconds"] for r in impl_runs
        )
        med["free_seconds"] = pick_of(impl_runs, ("per_method", "free", "seconds"), pick)
        med["cpu_share"] = pick_of(impl_runs, ("runner", "cpu_share"), pick)
        if "decode_step" in impl_runs[0]:
            # The mean (not the median) over full-batch steps, comparable with vLLM's figure.
            med["decode_step_us"] = pick_of(impl_runs, ("decode_step", "us_per_step_mean"), pick)
        else:  # the kit's vLLM driver does not time steps: mean per-call time × running requests
            batch = impl_runs[0]["args"]["batch"]
            med["decode_step_us"] = (
                med["allocate_slots_decode"] * batch if med["allocate_slots_decode"] else None
            )
        out[impl] = med
    out["ratio_pagedkv_over_vllm"] = {
        key: _ratio(out["pagedkv"][key], out["vllm"][key]) for key in out["vllm"]
    }
    if "pagedkv_batched" in out:
        out["ratio_batched_over_vllm"] = {
            key: _ratio(out["pagedkv_batched"][key], out["vllm"][key]) for key in out["vllm"]
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def print_table(name: str, argv: list[str], summary: dict, best: dict, stats: dict) -> None:
    """Medians per implementation, then pagedkv/vLLM ratios of the medians and of the bests."""
    impls = [i for i in ("vllm", "pagedkv", "pagedkv_batched") if i in summary]
    print(f"\n== {name}: {' '.join(argv)}")
    print(
        f"   steps {stats['steps']}, hit rate {stats['prefix_hit_rate']}, "
        f"preemptions {stats['preemptions']}, admission failures {stats['admission_failures']}"
    )
    if "request_block_digests" in stats:
        print(
            f"   block ids identical for all {stats['request_block_digests']} requests "
            f"(digest {stats['block_ids_digest']}), free-queue order identical"
        )
    ratio_keys = [
        ("ratio_pagedkv_over_vllm", "p/v med", summary),
        ("ratio_pagedkv_over_vllm", "p/v best", best),
    ]
    if "pagedkv_batched" in impls:
        ratio_keys += [
            ("ratio_batched_over_vllm", "b/v med", summary),
            ("ratio_batched_over_vllm", "b/v best", best),
        ]
    header = f"{'median of runs':32}" + "".join(f"{i:>16}" for i in impls)
    header += "".join(f"{label:>10}" for _, label, _ in ratio_keys)
    print(header)
    rows = [(f"us/call {m}", m) for m in METHODS] + [
        ("us get_computed+alloc_prefill", "prefill_pair"),
        ("us decode phase per step", "decode_step_us"),
        ("manager s (whole workload)", "manager_seconds"),
        ("hash s (requests+appends)", "hash_seconds"),
        ("manager+hash s", "manager_plus_hash_seconds"),
        ("child CPU share (1 = no wait)", "cpu_share"),
    ]
    for label, key in rows:
        if all(summary[impl].get(key) is None for impl in impls):
            continue
        line = f"{label:32}"
        for impl in impls:
            value = summary[impl].get(key)
            line += f"{value:>16.3f}" if value is not None else f"{'-':>16}"
        for ratio_name, _, source in ratio_keys:
            ratio = source[ratio_name].get(key) if key != "cpu_share" else None
            line += f"{ratio:>10.3f}" if ratio is not None else f"{'-':>10}"
        print(line)
    how = (
        "measured by the shared loop"
        if "request_block_digests" in stats
        else "derived (mean us/call decode x running requests)"
    )
    print(f"   vLLM's decode phase per step is {how}; best = min over runs")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = [
        n.strip()
        for n in ",".join(PRESETS.get(w.strip(), w) for w in args.workloads.split(",")).split(",")
        if n.strip()
    ]
    for name in names:
        if name not in WORKLOADS and name not in SCENARIO_WORKLOADS:
            raise SystemExit(
                f"unknown workload {name!r}; choose from "
                f"{', '.join([*WORKLOADS, *SCENARIO_WORKLOADS, *PRESETS])}"
            )
    if not Path(args.vllm_python).exists():
        raise SystemExit(
            f"no peer venv python at {args.vllm_python}: build it with "
            "bash benchmarks/peer/vllm/setup_venv.sh DIR, then pass "
            "--vllm-python DIR/bin/python"
        )
    env = pagedkv_env()
    batched = not args.no_batched and has_batched_decode(args.pagedkv_python, env)
    hash_args = ["--hash", args.hash]
    started = time.strftime("%Y%m%d-%H%M%S")
    record: dict = {
        "command": " ".join([sys.executable, *sys.argv]),
        "started": started,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": os.getloadavg(),
        },
        "reps": args.reps,
        "clock": args.clock,
        "batched_decode": batched,
        "workloads": {},
    }
    for name in names:
        argv_w = workload_args(name, args.quick) + hash_args
        scenario = name in SCENARIO_WORKLOADS
        runs: dict[str, list[dict]] = {"vllm": [], "pagedkv": []}
        if batched:
            runs["pagedkv_batched"] = []
        for rep in range(args.reps):
            order = list(runs) if rep % 2 == 0 else list(reversed(runs))
            for impl in order:
                print(f"[{name} rep {rep + 1}/{args.reps}] {impl}", file=sys.stderr, flush=True)
                if impl == "vllm":
                    driver = SCENARIO_DRIVER if scenario else VLLM_DRIVER
                    extra = ["--impl", "vllm"] if scenario else []
                    result = run_driver(
                        args.vllm_python, driver, argv_w + extra, dict(os.environ), args.clock
                    )
                else:
                    driver = SCENARIO_DRIVER if scenario else PAGEDKV_DRIVER
                    extra = ["--impl", "pagedkv"] if scenario else []
                    if impl == "pagedkv_batched":
                        extra.append("--batched-decode")
                    result = run_driver(
                        args.pagedkv_python, driver, argv_w + extra, env, args.clock
                    )
                runs[impl].append(result)
            for impl in runs:
                if impl != "vllm":
                    assert_same_workload(name, runs["vllm"][-1], runs[impl][-1], impl)
        summary = summarize(runs)
        best = summarize(runs, pick=min)
        stats = {k: runs["vllm"][0][k] for k in (SCENARIO_STATS if scenario else WORKLOAD_STATS)}
        if scenario:
            stats["request_block_digests"] = len(runs["vllm"][0]["request_block_digests"])
        print_table(name, argv_w, summary, best, stats)
        record["workloads"][name] = {
            "args": argv_w,
            "workload_stats": stats,
            "median": summary,
            "best": best,
            "runs": runs,
        }
    record["machine"]["loadavg_end"] = os.getloadavg()
    default_out = REPO / "benchmarks" / "results" / f"peer_compare_{started}.json"
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(
        f"\nloadavg start {record['machine']['loadavg_start']} end "
        f"{record['machine']['loadavg_end']} ({os.cpu_count()} CPUs); JSON: {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
