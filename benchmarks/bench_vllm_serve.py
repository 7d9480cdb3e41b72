"""Serve mode's speed with vLLM's own scheduler in the loop (issue 21), run by hand in a venv with
vLLM 0.33 (the `[vllm]` extra, or .ci/vllm-suites' .vllm-ci/venv).

The same trace and settings are served by pagedkv's reference scheduler and by vLLM's
`Scheduler` (on pagedkv's manager, on vLLM's, with async scheduling on and off), in one
process, alternating run by run; each run's loop is timed apart from its set-up (vLLM's
config). Prints a Markdown table (steps/s, the ratio to the reference, the key results) and one
JSON line. Any `pagedkv simulate` serve option can be passed after `--`.

    python benchmarks/bench_vllm_serve.py [--repeats 2] [--variants ref pagedkv vllm] \\
        -- --trace traces/conversation_trace.jsonl
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

VARIANTS = ("ref", "pagedkv", "vllm", "pagedkv-async", "vllm-async")


def serve_once(variant: str, trace, config, model_dir: str) -> tuple[float, dict]:
    """(loop seconds, summary) of one run."""
    gc.collect()
    if variant == "ref":
        from pagedkv.sim.serve import ServeRun

        run = ServeRun(trace, config)
    else:
        from pagedkv.sim.vllm_options import VllmOptions
        from pagedkv.sim.vllm_serve import VllmServeRun

        kv_manager, _, mode = variant.partition("-")
        options = VllmOptions(kv_manager, async_scheduling=mode == "async")
        run = VllmServeRun(trace, config, options, model_dir)
    start = time.perf_counter()
    run.run(None)
    loop_s = time.perf_counter() - start
    return loop_s, run.summary()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("simulate_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    from pagedkv.cli.simulate import command as cli_simulate
    from pagedkv.sim import cost_model

    simulate_parser = argparse.ArgumentParser()
    cli_simulate.add_arguments(simulate_parser)
    extra = [item for item in args.simulate_args if item != "--"]
    sim_args = simulate_parser.parse_args(["--mode", "serve", *extra])
    sim_args.time_scale = sim_args.time_scale or 1.0
    cli_simulate.sweep.normalize(sim_args, cli_simulate._error, True)  # one value per axis
    trace = cli_simulate._load(sim_args)
    config, _ = cli_simulate._serve_config(sim_args, cost_model)
    model_dir = tempfile.mkdtemp(prefix="pagedkv-vllm-model-")
    from pagedkv.sim.vllm_serve import write_model_config

    write_model_config(model_dir, config.max_model_len)
    times: dict[str, list[float]] = {variant: [] for variant in args.variants}
    summaries: dict[str, dict] = {}
    for _ in range(args.repeats):
        for variant in args.variants:  # alternate A/B/...
            loop_s, summary = serve_once(variant, trace, config, model_dir)
            times[variant].append(loop_s)
            summaries[variant] = summary
    rows = {}
    for variant in args.variants:
        summary = summaries[variant]
        loop_s = statistics.median(times[variant])
        rows[variant] = {
            "loop_s": loop_s,
            "steps": summary["num_steps"],
            "steps_per_s": summary["num_steps"] / loop_s,
            "ttft_p50_s": summary["ttft_s"]["p50"],
            "tpot_p50_s": summary["tpot_s"]["p50"],
            "hit_rate": summary["prefix_cache"]["hit_rate"],
            "preemptions": summary["preemptions"]["num_preemptions"],
            "same_as_ref": summaries.get("ref") == summary if "ref" in summaries else None,
        }
    reference = rows.get("ref", {}).get("steps_per_s")
    print(f"{trace.name}: {len(trace.requests):,} requests")
    print(
        "| scheduler | steps | loop (s) | steps/s | vs reference | TTFT p50 (s) | TPOT p50 (ms) "
        "| hit rate | preemptions | report = reference's |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for variant, row in rows.items():
        ratio = f"{row['steps_per_s'] / reference:.2f}x" if reference else "-"
        tpot = "n/a" if row["tpot_p50_s"] is None else f"{1000 * row['tpot_p50_s']:.2f}"
        print(
            f"| {variant} | {row['steps']:,} | {row['loop_s']:.1f} | {row['steps_per_s']:,.0f} "
            f"| {ratio} | {row['ttft_p50_s']} | {tpot} | {100 * row['hit_rate']:.2f} % "
            f"| {row['preemptions']:,} | {row['same_as_ref']} |"
        )
    import vllm

    print(
        json.dumps(
            {"vllm": vllm.__version__, "python": platform.python_version(), "rows": rows},
            default=str,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
