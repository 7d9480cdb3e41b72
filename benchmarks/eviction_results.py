"""The eviction results table of README (issue 13 item 6), run by hand; long on full traces.

Replays each trace at each block size through every eviction policy (one pass per policy
group, to bound memory) at capacities of 1M to 16M tokens, writes one JSON per (trace, block
size) to benchmarks/results/, and prints the README's markdown table from whatever JSON is
there. The replay is `pagedkv.sim.eviction_replay.replay_policies`, the same as

    pagedkv simulate --mode replay --trace TRACE --block-size BS --eviction all \\
        --capacity 1Mtok,2Mtok,4Mtok,8Mtok,16Mtok

    python benchmarks/eviction_results.py run [--traces conversation] [--block-sizes 16]
    python benchmarks/eviction_results.py table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pagedkv.eviction import EVICTION_POLICY_NAMES, ONLINE_POLICY_NAMES
from pagedkv.sim.eviction_replay import replay_policies
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.report.eviction import gap_closed

# The full Mooncake traces (kvcache-ai/Mooncake on GitHub, FAST25-release/traces/), in
# --trace-dir under these names.
TRACES = {
    "conversation": "conversation_trace.jsonl",
    "synthetic": "synthetic_trace.jsonl",
}
CAPACITY_TOKENS = (1_000_000, 2_000_000, 4_000_000, 8_000_000, 16_000_000)
RESULTS = Path(__file__).resolve().parent / "results"


def run(
    trace_dir: Path, trace_names: list[str], block_sizes: list[int], policies: list[str]
) -> None:
    RESULTS.mkdir(exist_ok=True)
    for name in trace_names:
        trace = load_trace(trace_dir / TRACES[name])
        for block_size in block_sizes:
            path = RESULTS / f"eviction_{name}_{block_size}.json"
            done = json.loads(path.read_text()) if path.exists() else {"points": []}
            capacities = [tokens // block_size for tokens in CAPACITY_TOKENS]
            # One pass for every policy: the trace is hashed once (twice with belady's future);
            # the sweep's memory estimate is checked against the machine's before it starts.
            groups = [policies]
            for group in groups:
                group = [p for p in group if p not in {q["policy"] for q in done["points"]}]
                if not group:
                    continue
                start_cpu, start_wall = time.process_time(), time.perf_counter()
                points = replay_policies(trace, capacities, group, block_size)
                cpu_s = time.process_time() - start_cpu
                wall_s = time.perf_counter() - start_wall
                nominal = dict(zip(capacities, CAPACITY_TOKENS, strict=True))
                done["points"] += [
                    {
                        "policy": point.policy,
                        "capacity_tokens": nominal[point.capacity_blocks],
                        "capacity_blocks": point.capacity_blocks,
                        "hit_rate": point.hit_rate,
                        "num_hit_tokens": point.num_device_hit_tokens,
                        "num_requests_not_fit": point.num_requests_not_fit,
                    }
                    for point in points
                ]
                done.setdefault("runs", []).append(
                    {"policies": group, "cpu_s": round(cpu_s, 1), "wall_s": round(wall_s, 1)}
                )
                path.write_text(json.dumps(done, indent=1))
                print(f"{name} bs{block_size} {group}: {cpu_s:.0f} s CPU", file=sys.stderr)


def table() -> str:
    """One markdown row per (trace, block size, capacity): hit rate per policy, the best
    online policy and the share of the LRU-to-Belady gap it closes."""
    header = ["trace", "block", "capacity", *EVICTION_POLICY_NAMES, "best online", "gap closed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in sorted(RESULTS.glob("eviction_*_*.json")):
        _, name, block_size = path.stem.split("_")
        points = json.loads(path.read_text())["points"]
        for capacity in CAPACITY_TOKENS:
            rates = {p["policy"]: p["hit_rate"] for p in points if p["capacity_tokens"] == capacity}
            if not rates:
                continue
            online = {p: rates[p] for p in ONLINE_POLICY_NAMES if p in rates}
            best = max(online, key=lambda p: online[p]) if online else None
            closed = None
            if best and "lru" in rates and "belady" in rates:
                closed = gap_closed(rates["lru"], online[best], rates["belady"])
            cells = [name, block_size, f"{capacity // 1_000_000}M"]
            cells += [f"{100 * rates[p]:.2f}" if p in rates else "" for p in EVICTION_POLICY_NAMES]
            cells += [best or "", "" if closed is None else f"{100 * closed:.0f} %"]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("run", "table"))
    parser.add_argument("--traces", default="conversation,synthetic")
    parser.add_argument(
        "--trace-dir",
        type=Path,
        default=Path("traces"),
        help="folder holding the full Mooncake traces (conversation_trace.jsonl, "
        "synthetic_trace.jsonl; default ./traces)",
    )
    parser.add_argument("--block-sizes", default="512,16")
    parser.add_argument("--policies", default=",".join(EVICTION_POLICY_NAMES))
    args = parser.parse_args()
    if args.what == "run":
        run(
            args.trace_dir,
            args.traces.split(","),
            [int(b) for b in args.block_sizes.split(",")],
            args.policies.split(","),
        )
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
