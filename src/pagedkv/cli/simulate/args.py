"""`pagedkv simulate`'s options: their definitions and the mode a run resolves to.

Imports only the standard library (and the CLI's argument checks) at module level.
"""

from __future__ import annotations

import argparse

from pagedkv.cli._checks import float_in, int_at_least
from pagedkv.cli.simulate import cluster, eviction, sweep


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("input")
    choice = source.add_mutually_exclusive_group()
    choice.add_argument(
        "--trace",
        metavar="PATH",
        help="JSONL trace (Mooncake, token ids or lengths); a comma list is a sweep (default "
        "the shipped Mooncake conversation sample, 1,000 requests)",
    )
    choice.add_argument(
        "--workload",
        choices=("shared-prompt", "chat", "agent"),
        help="a seeded synthetic workload instead of a trace",
    )
    source.add_argument(
        "--num-requests",
        type=int_at_least(1),
        metavar="N",
        help="use the first N requests of the trace; workloads generate N (default the "
        "whole trace, 300 requests in the memory study, 400 for a workload)",
    )
    source.add_argument(
        "--rate",
        type=float_in(0, open_minimum=True),
        default=2.0,
        metavar="PER_S",
        help="workloads: request (or session) arrival rate (default 2)",
    )
    source.add_argument(
        "--arrival",
        choices=("poisson", "bursty"),
        default="poisson",
        help="workloads: arrival process (default poisson)",
    )
    source.add_argument("--seed", type=int, default=0, help="workloads: random seed (default 0)")

    sim = parser.add_argument_group("simulation")
    sim.add_argument(
        "--mode",
        choices=("memory", "serve", "replay"),
        help="memory: serve at several KV-cache sizes and report what each buys (the default, "
        "also with --trace, --workload, --num-requests, --capacity LIST, --profile and the "
        "scheduler options); serve: time-stepped serving with the scheduler (the default with "
        "one --capacity, --instances, --eviction, --model, --scheduler vllm or a sweep); replay: "
        "cache-capacity study, one request at a time",
    )
    sim.add_argument(
        "--block-size",
        type=sweep.block_sizes_text,
        default="16",
        metavar="TOKENS",
        help="tokens per block (default 16); a comma list (16,64) is a sweep",
    )
    sim.add_argument(
        "--capacity",
        metavar="LIST",
        help="KV capacity: blocks (1000, 20k, 1M) or tokens (4Mtok); replay "
        "takes a comma-separated sweep and 'unlimited', the memory study a list of sizes; "
        "serve takes one value (default what the profile's GPU memory holds)",
    )
    sim.add_argument(
        "--model",
        metavar="NAME_OR_CONFIG",
        help="take the KV-cache groups (full, sliding window, chunked local, Mamba...) and "
        "num_blocks from this model (a shipped name such as gemma-3-12b-it, a config.json or "
        "a model directory) sized for --memory (default one synthetic full-attention group)",
    )
    sim.add_argument(
        "--memory",
        metavar="SIZE",
        help="with --model: KV-cache memory budget (80GiB, 80GB, 512MiB or bytes)",
    )
    sim.add_argument(
        "--hash-algorithm",
        default="sha256",
        choices=("sha256", "sha256_cbor", "xxh3_128"),
        help="prefix-cache hash (default sha256)",
    )
    sim.add_argument(
        "--hash-tokens",
        action="store_true",
        help="hash every block's tokens (--hash-algorithm) instead of keying blocks by the "
        "trace's token runs: the same hits, several times slower (a cluster always hashes: "
        "its KV events carry the digests)",
    )
    sim.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        help="worker processes for a replay sweep, a memory study or a grid's cells, or the "
        "CPUs of the local Ray that --executor ray starts (default one per core; 1: in this "
        "process)",
    )

    serve = parser.add_argument_group("serve mode")
    serve.add_argument(
        "--profile",
        default=None,
        metavar="NAME",
        help="model/GPU cost profile (default llama3.1-8b-h100; --list-profiles shows all); "
        "a comma list is a sweep",
    )
    serve.add_argument(
        "--list-profiles",
        action="store_true",
        help="print the built-in profiles and their coefficients, then exit",
    )
    serve.add_argument(
        "--cost",
        metavar="NAME=SECONDS,...",
        help="override cost coefficients: step_overhead_s, prefill_token_s, "
        "decode_seq_s, kv_token_read_s, prefill_attention_pair_s",
    )
    serve.add_argument(
        "--time-scale",
        type=float_in(0, open_minimum=True),
        help="multiply arrival times, 0.5 = twice the request rate (default 1; in the memory "
        "study the scale at which the GPU is about 70 %% busy)",
    )
    serve.add_argument(
        "--max-model-len",
        type=int_at_least(1),
        metavar="TOKENS",
        help="longest request (default the profile's, capped by capacity)",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int_at_least(1),
        default=8192,
        help="token budget per step (default 8192)",
    )
    serve.add_argument(
        "--max-num-seqs", type=int_at_least(1), default=256, help="requests per step (default 256)"
    )
    serve.add_argument(
        "--policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="scheduling policy (default fcfs)",
    )
    serve.add_argument(
        "--watermark",
        type=float_in(0, 1),
        default=0.0,
        help="fraction of blocks kept free from new admissions (default 0)",
    )
    serve.add_argument(
        "--long-prefill-token-threshold",
        type=int_at_least(0),
        default=0,
        metavar="TOKENS",
        help="cap prompt tokens per request per step (default 0: no cap)",
    )
    serve.add_argument(
        "--no-chunked-prefill", action="store_true", help="schedule each prompt in one step"
    )
    serve.add_argument(
        "--async-caching",
        action="store_true",
        help="cache a step's blocks only after its output arrives",
    )
    serve.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")

    output = parser.add_argument_group("output")
    output.add_argument(
        "--json",
        action="store_true",
        help="print the report as JSON (deterministic) instead of a table",
    )
    output.add_argument(
        "--plot",
        metavar="FILE",
        help="write a plot (needs matplotlib; the extension picks the format: .png, .svg, "
        ".pdf...): hit rate vs capacity (replay), usage and queues over time (serve)",
    )
    output.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    output.add_argument(
        "--output",
        metavar="FILE",
        help="also write the results as tidy rows, one per cell and metric (.parquet needs "
        "the [parquet] extra, .csv writes FILE.meta.json beside it): command line and "
        "version included",
    )
    cluster.add_arguments(parser)
    sweep.add_arguments(parser)
    eviction.add_arguments(parser)
    # Every option's default, to tell a run with no simulation option (the memory study).
    parser.set_defaults(_option_defaults=vars(parser.parse_args([])))


# Options that change only how results are shown or computed, not what is simulated.
_OUTPUT_OPTIONS = frozenset(
    {"json", "plot", "no_progress", "jobs", "output", "executor", "ray_address"}
)
# Options the memory study reads too (the workload, the scheduler, the cost model, the KV
# sizes): given without --mode they keep the main job. Any other simulation option (a cluster,
# an eviction policy, a --model, vLLM's scheduler, a sweep) selects serve mode.
_MEMORY_OPTIONS = frozenset(
    {
        "trace", "workload", "num_requests", "seed", "rate", "arrival", "capacity",
        "time_scale", "profile", "cost", "block_size", "max_model_len",
        "max_num_batched_tokens", "max_num_seqs", "policy", "watermark", "no_chunked_prefill",
        "no_prefix_caching", "long_prefill_token_threshold", "async_caching",
    }
)  # fmt: skip
# A comma list in these makes a sweep (replay or serve cells), never the memory study.
_SWEEP_AXES = ("trace", "block_size", "profile")
# The study takes a list of sizes; one --capacity is one serve run at that size.


def resolve_mode(args: argparse.Namespace) -> str:
    """`--mode`, or memory unless an option the memory study does not take is given (serve)."""
    if args.mode is not None:
        return str(args.mode)
    defaults = getattr(args, "_option_defaults", {})
    for name, default in defaults.items():
        if name in _OUTPUT_OPTIONS or name.startswith("_") or name == "mode":
            continue
        value = getattr(args, name, default)
        if value == default:
            continue
        if name not in _MEMORY_OPTIONS:
            return "serve"
        if name in _SWEEP_AXES and "," in str(value):
            return "serve"
        if name == "capacity" and "," not in str(value):
            return "serve"
    return "memory"
