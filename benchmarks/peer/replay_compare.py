#!/usr/bin/env python3
"""Trace replay, side by side: `pagedkv simulate --mode replay` against vLLM 0.33's manager.

Each repetition runs both as child processes of this runner, alternating which goes first:
the whole `pagedkv simulate --mode replay --trace T --block-size B --capacity C --json`
process (this interpreter, this checkout's src/ first on PYTHONPATH), and
`vllm_replay.py` under the peer venv's python (tokens built from the trace's hash ids as
pagedkv's loader builds them, vLLM's SHA-256 block hasher, `get_computed_blocks`,
`allocate_slots`, `free`). CPU time is the child's user + system time (getrusage). The runner
stops unless both report the same hit tokens and requests not fit. Medians go into the table
and into a JSON file under benchmarks/results/.

  python benchmarks/peer/replay_compare.py --vllm-python .peer-venv/bin/python \\
      --trace traces/conversation_trace.jsonl
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
VLLM_REPLAY = HERE / "vllm_replay.py"
DEFAULT_VLLM_PYTHON = os.environ.get("PEER_PYTHON", str(REPO / ".peer-venv" / "bin" / "python"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=1_000_000, help="usable blocks")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON, help="env PEER_PYTHON")
    parser.add_argument("--pagedkv-python", default=sys.executable)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/)")
    return parser.parse_args(argv)


def run_child(cmd: list[str], env: dict[str, str]) -> tuple[str, float, float]:
    """Run one child to completion; its stdout, CPU seconds (user + system) and wall seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    wall_s = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return proc.stdout, cpu_s, wall_s


def run_pagedkv(args: argparse.Namespace) -> dict:
    cmd = [
        args.pagedkv_python, "-m", "pagedkv", "simulate", "--mode", "replay",
        "--trace", args.trace, "--block-size", str(args.block_size),
        "--capacity", str(args.capacity), "--json",
    ]  # fmt: skip
    if args.num_requests:
        cmd += ["--num-requests", str(args.num_requests)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    stdout, cpu_s, wall_s = run_child(cmd, env)
    (point,) = json.loads(stdout)["results"]
    return {
        "num_hit_tokens": point["num_hit_tokens"],
        "num_requests_not_fit": point["num_requests_not_fit"],
        "process_cpu_s": round(cpu_s, 3),
        "wall_s": round(wall_s, 3),
    }


def run_vllm(args: argparse.Namespace) -> dict:
    cmd = [
        args.vllm_python, str(VLLM_REPLAY), "--trace", args.trace,
        "--block-size", str(args.block_size), "--capacity", str(args.capacity),
    ]  # fmt: skip
    if args.num_requests:
        cmd += ["--num-requests", str(args.num_requests)]
    stdout, cpu_s, wall_s = run_child(cmd, dict(os.environ))
    result = json.loads(stdout.strip().splitlines()[-1])
    result["process_cpu_s"] = round(cpu_s, 3)  # the runner's measure, as for pagedkv
    result["wall_s"] = round(wall_s, 3)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    runs: dict[str, list[dict]] = {"pagedkv": [], "vllm": []}
    for rep in range(args.reps):
        order = ("pagedkv", "vllm") if rep % 2 == 0 else ("vllm", "pagedkv")
        for name in order:
            result = run_pagedkv(args) if name == "pagedkv" else run_vllm(args)
            runs[name].append(result)
            print(f"rep {rep} {name}: {json.dumps(result)}", file=sys.stderr, flush=True)
        mine, theirs = runs["pagedkv"][-1], runs["vllm"][-1]
        for key in ("num_hit_tokens", "num_requests_not_fit"):
            if mine[key] != theirs[key]:
                raise SystemExit(f"{key} differs: pagedkv {mine[key]}, vLLM {theirs[key]}")
    pagedkv_cpu = statistics.median(r["process_cpu_s"] for r in runs["pagedkv"])
    vllm_cpu = statistics.median(r["process_cpu_s"] for r in runs["vllm"])
    vllm_replay_cpu = statistics.median(r["replay_cpu_s"] for r in runs["vllm"])
    summary = {
        "trace": args.trace,
        "block_size": args.block_size,
        "capacity_blocks": args.capacity,
        "num_hit_tokens": runs["pagedkv"][0]["num_hit_tokens"],
        "reps": args.reps,
        "pagedkv_process_cpu_s": pagedkv_cpu,
        "vllm_process_cpu_s": vllm_cpu,
        "vllm_replay_cpu_s": vllm_replay_cpu,
        "ratio_process": round(pagedkv_cpu / vllm_cpu, 4),
        "ratio_to_vllm_replay_only": round(pagedkv_cpu / vllm_replay_cpu, 4),
        "load_average": os.getloadavg(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.python_version()}",
        "runs": runs,
    }
    stamp = time.strftime("%Y%m%d_%H%M%S")
    out = Path(args.out or REPO / "benchmarks" / "results" / f"replay_compare_{stamp}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"hit tokens {summary['num_hit_tokens']:,} (identical in every run)\n"
        f"CPU s, median of {args.reps}: pagedkv whole process {pagedkv_cpu:.1f}; vLLM whole "
        f"process {vllm_cpu:.1f}, its replay loop alone {vllm_replay_cpu:.1f}\n"
        f"ratio pagedkv / vLLM: {summary['ratio_process']:.3f} (whole processes), "
        f"{summary['ratio_to_vllm_replay_only']:.3f} (against vLLM's loop without its imports)\n"
        f"wrote {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
