"""The serving-signal eviction tables of docs/design.md (issue 20 item 2), run by hand.

Replay (each prompt alone, no queue; Belady's bound) and serve mode (arrivals, the queue,
chunked prefill, preemption, the default profile's cost model) on prefixes of both Mooncake
traces, sized to run in minutes on a shared 2-core machine. Writes one JSON per table to
benchmarks/results/ and prints the markdown tables from whatever JSON is there.

    python benchmarks/eviction_signals.py replay [--traces conversation] [--block-sizes 512]
    python benchmarks/eviction_signals.py serve [--traces conversation] [--block-sizes 16]
    python benchmarks/eviction_signals.py table
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from pagedkv.sim.cost_model import DEFAULT_PROFILE, get_profile
from pagedkv.sim.eviction_replay import replay_policies
from pagedkv.sim.inputs.traces import load_trace
from pagedkv.sim.report.eviction import gap_closed
from pagedkv.sim.serve import ServeConfig, simulate_serving

TRACES = {
    "conversation": "/work/shared/traces/mooncake_conversation_trace.jsonl",
    "synthetic": "/work/shared/traces/mooncake_synthetic_trace.jsonl",
}
# Prefixes (first N requests) that keep each table to minutes of CPU.
REPLAY_REQUESTS = {"conversation": 4000, "synthetic": 3993}
SERVE_REQUESTS = {"conversation": 600, "synthetic": 600}
# Arrivals slowed so the default profile's GPU runs at about 80 % load on each trace (as
# recorded, both are beyond what one H100 serving an 8B model can prefill: the queue only grows).
SERVE_TIME_SCALE = {"conversation": 5.0, "synthetic": 4.0}
CAPACITY_TOKENS = (1_000_000, 2_000_000, 4_000_000)
REPLAY_POLICIES = ("lru", "s3fifo", "arc", "continuation", "hazard", "belady")
ONLINE_REPLAY = REPLAY_POLICIES[:-1]
# (policy, look-ahead) pairs served.
SERVE_POLICIES = (
    ("lru", False),
    ("s3fifo", False),
    ("continuation", False),
    ("hazard", False),
    ("lru", True),
    ("hazard", True),
)
RESULTS = Path(__file__).resolve().parent / "results"


def run_replay(trace_names: list[str], block_sizes: list[int]) -> None:
    RESULTS.mkdir(exist_ok=True)
    for name in trace_names:
        trace = load_trace(TRACES[name], limit=REPLAY_REQUESTS[name])
        for block_size in block_sizes:
            capacities = [tokens // block_size for tokens in CAPACITY_TOKENS]
            start = time.process_time()
            points = replay_policies(trace, capacities, REPLAY_POLICIES, block_size)
            cpu_s = time.process_time() - start
            rows = [
                {
                    "policy": p.policy,
                    "capacity_tokens": CAPACITY_TOKENS[capacities.index(p.capacity_blocks)],
                    "hit_rate": p.hit_rate,
                }
                for p in points
            ]
            path = RESULTS / f"signals_replay_{name}_{block_size}.json"
            record = {"requests": len(trace.requests), "cpu_s": round(cpu_s, 1), "points": rows}
            path.write_text(json.dumps(record, indent=1))
            print(f"replay {name} bs{block_size}: {cpu_s:.0f} s CPU", file=sys.stderr)


def serve_capacities(block_size: int) -> dict[str, int]:
    """A quarter and a half of the default profile's KV memory, and 1M tokens, in blocks."""
    gpu = get_profile(DEFAULT_PROFILE).num_kv_blocks(block_size)
    return {"1/4 GPU": gpu // 4, "1/2 GPU": gpu // 2, "1M": 1_000_000 // block_size}


def run_serve(trace_names: list[str], block_sizes: list[int]) -> None:
    RESULTS.mkdir(exist_ok=True)
    profile = get_profile(DEFAULT_PROFILE)
    for name in trace_names:
        trace = load_trace(TRACES[name], limit=SERVE_REQUESTS[name])
        for block_size in block_sizes:
            rows = []
            start = time.process_time()
            for label, num_blocks in serve_capacities(block_size).items():
                for policy, lookahead in SERVE_POLICIES:
                    config = ServeConfig(
                        num_blocks=num_blocks,
                        cost_model=profile.cost_model(),
                        block_size=block_size,
                        max_model_len=min(profile.max_model_len, num_blocks * block_size),
                        eviction=policy,
                        lookahead=lookahead,
                        time_scale=SERVE_TIME_SCALE[name],
                    )
                    summary = simulate_serving(trace, config).summary
                    rows.append(
                        {
                            "capacity": label,
                            "capacity_tokens": num_blocks * block_size,
                            "policy": policy + ("+lookahead" if lookahead else ""),
                            "hit_rate": summary["prefix_cache"]["hit_rate"],
                            "ttft_p50_s": summary["ttft_s"]["p50"],
                            "ttft_p90_s": summary["ttft_s"]["p90"],
                            "preemptions": summary["preemptions"]["num_preemptions"],
                            "rejected": summary["num_requests_rejected"],
                        }
                    )
            cpu_s = time.process_time() - start
            path = RESULTS / f"signals_serve_{name}_{block_size}.json"
            record = {"requests": len(trace.requests), "cpu_s": round(cpu_s, 1), "rows": rows}
            path.write_text(json.dumps(record, indent=1))
            print(f"serve {name} bs{block_size}: {cpu_s:.0f} s CPU", file=sys.stderr)


def replay_table() -> str:
    header = ["trace", "block", "capacity", *REPLAY_POLICIES, "best online", "gap closed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in sorted(RESULTS.glob("signals_replay_*.json")):
        _, _, name, block_size = path.stem.split("_")
        record = json.loads(path.read_text())
        for tokens in CAPACITY_TOKENS:
            rates = {
                p["policy"]: p["hit_rate"]
                for p in record["points"]
                if p["capacity_tokens"] == tokens
            }
            best = max(ONLINE_REPLAY, key=lambda policy: rates[policy])
            closed = gap_closed(rates["lru"], rates[best], rates["belady"])
            cells = [f"{100 * rates[p]:.2f}" for p in REPLAY_POLICIES]
            closed_text = "-" if closed is None else f"{100 * closed:.0f} %"
            lines.append(
                f"| {name} {record['requests']} | {block_size} | {tokens // 1_000_000}M | "
                + " | ".join(cells)
                + f" | {best} | {closed_text} |"
            )
    return "\n".join(lines)


def serve_table() -> str:
    header = ["trace", "block", "capacity", "policy", "hit %", "TTFT p50 s", "TTFT p90 s",
              "preemptions", "p50 vs lru"]  # fmt: skip
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for path in sorted(RESULTS.glob("signals_serve_*.json")):
        _, _, name, block_size = path.stem.split("_")
        record = json.loads(path.read_text())
        base = {r["capacity"]: r for r in record["rows"] if r["policy"] == "lru"}
        for row in record["rows"]:
            lru_p50 = base[row["capacity"]]["ttft_p50_s"]
            change = (row["ttft_p50_s"] / lru_p50 - 1) if lru_p50 else 0.0
            lines.append(
                f"| {name} {record['requests']} | {block_size} | {row['capacity']} | "
                f"{row['policy']} | {100 * row['hit_rate']:.2f} | {row['ttft_p50_s']:.3g} | "
                f"{row['ttft_p90_s']:.3g} | {row['preemptions']} | {100 * change:+.1f} % |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("replay", "serve", "table"))
    parser.add_argument("--traces", default="conversation,synthetic")
    parser.add_argument("--block-sizes", default="16,512")
    args = parser.parse_args()
    traces = args.traces.split(",")
    block_sizes = [int(size) for size in args.block_sizes.split(",")]
    if args.what == "replay":
        run_replay(traces, block_sizes)
    elif args.what == "serve":
        run_serve(traces, block_sizes)
    print(replay_table())
    print()
    print(serve_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
