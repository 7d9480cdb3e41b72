"""CLI: `pagedkv simulate`, replay a request trace through the scheduler and the manager.

With no arguments it serves the Mooncake sample shipped in the package and prints a report.
Imports only the standard library at module level.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

from pagedkv.cli import _checks, _cluster, _eviction, _memory
from pagedkv.cli._checks import float_in, int_at_least
from pagedkv.cli._interrupt import StopOnCtrlC

COMMAND = "simulate"
HELP = "Simulate a request trace: prefix-cache hit rate, memory, preemptions, latency."

SAMPLE_TRACE = "mooncake_conversation_sample.jsonl"
_PROGRESS_DELAY_S = 1.0
_UNWRAPPED_WIDTH = 500  # columns rich may use when stdout is no terminal


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_argument_group("input")
    choice = source.add_mutually_exclusive_group()
    choice.add_argument(
        "--trace",
        metavar="PATH",
        help="JSONL trace (Mooncake, token ids or lengths); default: the "
        "shipped Mooncake conversation sample (1,000 requests)",
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
        help="use the first N requests of the trace (workloads: generate N, default 400)",
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
        help="memory: serve at several KV-cache sizes and report what each buys (the default "
        "when no option but --json/--plot/--no-progress/--jobs is given); serve: time-stepped "
        "serving with the scheduler (the default otherwise); replay: cache-capacity study, one "
        "request at a time",
    )
    sim.add_argument(
        "--block-size", type=int_at_least(1), default=16, help="tokens per block (default 16)"
    )
    sim.add_argument(
        "--capacity",
        metavar="LIST",
        help="KV capacity: blocks (1000, 20k, 1M) or tokens (4Mtok); replay "
        "takes a comma-separated sweep and 'unlimited', the memory study a list of sizes; "
        "serve takes one value (default: what the profile's GPU memory holds)",
    )
    sim.add_argument(
        "--model",
        metavar="NAME_OR_CONFIG",
        help="take the KV-cache groups (full, sliding window, chunked local, Mamba...) and "
        "num_blocks from this model (a shipped name such as gemma-3-12b-it, a config.json or "
        "a model directory) sized for --memory; default: one synthetic full-attention group",
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
        help="worker processes for a replay sweep or a memory study (default: one per core; "
        "1: in this process)",
    )

    serve = parser.add_argument_group("serve mode")
    serve.add_argument(
        "--profile",
        default=None,
        metavar="NAME",
        help="model/GPU cost profile (default llama3.1-8b-h100; --list-profiles shows all)",
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
        help="multiply arrival times (0.5 = twice the request rate; default 1, or in the "
        "memory study the scale at which the GPU is about 70 %% busy)",
    )
    serve.add_argument(
        "--max-model-len",
        type=int_at_least(1),
        metavar="TOKENS",
        help="longest request (default: the profile's, capped by capacity)",
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
    _cluster.add_arguments(parser)
    _eviction.add_arguments(parser)
    # Every option's default, to tell a run with no simulation option (the memory study).
    parser.set_defaults(_option_defaults=vars(parser.parse_args([])))


# Options that change only how results are shown or computed, not what is simulated.
_OUTPUT_OPTIONS = frozenset({"json", "plot", "no_progress", "jobs"})


def _resolve_mode(args: argparse.Namespace) -> str:
    """`--mode`, or memory when no simulation option is given, else serve."""
    if args.mode is not None:
        return str(args.mode)
    defaults = getattr(args, "_option_defaults", {})
    for name, default in defaults.items():
        if name in _OUTPUT_OPTIONS or name.startswith("_") or name == "mode":
            continue
        if getattr(args, name, default) != default:
            return "serve"
    return "memory"


def run(args: argparse.Namespace) -> int:
    from pagedkv.errors import PagedKVError

    try:
        return _run(args)
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"pagedkv simulate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from pagedkv.sim import cost_model, report

    if args.list_profiles:
        _print_profiles(cost_model)
        return 0
    args.mode = _resolve_mode(args)
    if args.mode == "memory" and not (args.trace or args.workload or args.num_requests):
        args.num_requests = _memory.DEFAULT_NUM_REQUESTS  # a few seconds for the whole study
    if args.mode == "replay" and (args.profile or args.cost):
        raise _error("--profile and --cost apply to --mode serve only")
    if args.memory and not args.model:
        raise _error("--memory sizes the KV cache of a --model: name one")
    if args.model and args.mode == "serve" and (args.capacity or not args.memory):
        raise _error("--mode serve with --model takes --memory (and no --capacity)")
    if args.model and args.mode == "replay" and bool(args.capacity) == bool(args.memory):
        raise _error(
            "--mode replay with --model takes --memory (one point at the sized num_blocks) "
            "or --capacity (blocks of the pool the groups share), not both"
        )
    if args.model and _cluster.wanted(args):
        raise _error("--model is not supported with a cluster (--instances) yet")
    _eviction.check(args, _error)
    if _eviction.wanted(args) and _cluster.wanted(args):
        raise _error("--eviction and --host-capacity are not supported with a cluster yet")
    _checks.check_simulate_args(args, cost_model, cluster=_cluster.wanted(args))
    if _cluster.wanted(args):
        _cluster.preflight(args)
    trace = _load(args)
    _checks.check_simulate_trace(args, trace)
    show_progress = not (args.json or args.no_progress) and sys.stderr.isatty()

    def make_progress(total: int, label: str) -> _Progress:
        return _Progress(total, label, show_progress)

    if _cluster.wanted(args):
        config, profile_name = _serve_config(args, cost_model)
        return _cluster.run(args, trace, config, profile_name, make_progress)
    plot = None
    if args.mode == "memory":
        the_report, speed = _memory.run(
            args, trace, cost_model, _serve_config, make_progress, _max_workers(args)
        )
    elif args.mode == "replay" and _eviction.wanted(args):
        the_report, speed, plot = _eviction.replay(args, trace, make_progress)
    elif args.mode == "replay":
        the_report, speed, plot = _replay(args, trace, show_progress)
    else:
        the_report, speed, plot = _serve(args, trace, cost_model, show_progress)
    if args.json:
        sys.stdout.write(report.to_json(the_report))
        print(
            f"simulated {speed.num_prompt_tokens_simulated:,} prompt tokens in "
            f"{speed.wall_s:.1f} s ({speed.prompt_tokens_per_s:,.0f} tokens/s)",
            file=sys.stderr,
        )
    else:
        _print_table(report, the_report, speed)
    if args.plot and plot is not None:
        plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    interrupted = args.mode == "serve" and the_report["results"].get("interrupted", False)
    return 130 if interrupted else 0


def _error(message: str) -> Exception:
    from pagedkv.errors import InvalidArgumentError

    return InvalidArgumentError(message)


def _load(args: argparse.Namespace) -> Any:
    from pagedkv.sim.traces import TraceWarning, load_trace
    from pagedkv.sim.workloads import WorkloadParams, make_workload

    if args.workload:
        params = WorkloadParams(
            num_requests=args.num_requests or 400,
            rate_per_s=args.rate,
            arrival=args.arrival,
            seed=args.seed,
        )
        return make_workload(args.workload, params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", TraceWarning)
        if args.trace:
            trace = load_trace(args.trace, limit=args.num_requests)
        else:
            from importlib import resources

            sample = resources.files("pagedkv") / "data" / SAMPLE_TRACE
            with resources.as_file(sample) as path:
                trace = load_trace(path, limit=args.num_requests)
    for warning in caught:
        print(f"pagedkv simulate: warning: {warning.message}", file=sys.stderr)
    return trace


def _replay(args: argparse.Namespace, trace: Any, show_progress: bool) -> tuple:
    from pagedkv.sim import replay
    from pagedkv.sim.report import Speed, replay_report

    capacities: list[int | None]
    groups = model_name = None
    if args.capacity:
        capacities = replay.parse_capacities(args.capacity, args.block_size)
        if args.model:
            model_name, groups = _model_groups(args)
    elif args.model:
        # Replay allocates whole prompts at once: size for the longest, nothing in flight saved.
        max_model_len = max((r.num_prompt_tokens for r in trace.requests), default=1)
        model_name, sizing = _size_model(args, max_model_len, max_in_flight_tokens=None)
        groups = sizing.kv_cache_config.kv_cache_groups
        capacities = [sizing.num_blocks - 1]  # usable blocks: the null block aside
    else:
        capacities = list(replay.default_capacities(trace, args.block_size))
    progress = _Progress(len(trace.requests), "replaying", show_progress)
    start = time.perf_counter()
    try:
        points = replay.replay(
            trace,
            capacities,
            args.block_size,
            args.hash_algorithm,
            progress,
            kv_cache_groups=groups,
            hash_tokens=args.hash_tokens,
            max_workers=_max_workers(args),
        )
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    num_managers = max(1, sum(1 for capacity in capacities if capacity is not None))
    speed = Speed(wall_s, trace.num_prompt_tokens * num_managers)
    the_report = replay_report(
        trace, points, args.block_size, args.hash_algorithm, model_name, groups
    )

    def plot(path: str) -> None:
        from pagedkv.sim.plot import plot_replay

        plot_replay(the_report, path)

    return the_report, speed, plot


def _max_workers(args: argparse.Namespace) -> int:
    from pagedkv.sim.processes import default_max_workers

    if args.jobs is None:
        return default_max_workers()
    if args.jobs < 1:
        raise _error(f"--jobs must be >= 1, got {args.jobs}")
    return args.jobs


def _serve(args: argparse.Namespace, trace: Any, cost_model: Any, show_progress: bool) -> tuple:
    from pagedkv.sim.report import Speed, serve_report
    from pagedkv.sim.serve import simulate_serving

    config, profile_name = _serve_config(args, cost_model)
    progress = _Progress(len(trace.requests), "serving", show_progress)
    start = time.perf_counter()
    try:
        with StopOnCtrlC() as stop:  # Ctrl-C ends the run; the report shows what it measured
            result = simulate_serving(trace, config, progress, stop)
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    speed = Speed(wall_s, result.summary["tokens"]["prompt"])
    model_name = _model_name(args.model) if args.model else None
    the_report = serve_report(trace, config, profile_name, result, model_name)

    def plot(path: str) -> None:
        from pagedkv.sim.plot import plot_serve

        plot_serve(the_report, result, path)

    return the_report, speed, plot


def _serve_config(args: argparse.Namespace, cost_model: Any) -> tuple[Any, str | None]:
    """The serve-mode configuration from the arguments, and the profile name to report."""
    from pagedkv.sched import SchedulerConfig
    from pagedkv.sim.replay import parse_capacities
    from pagedkv.sim.serve import ServeConfig

    profile = cost_model.get_profile(args.profile or cost_model.DEFAULT_PROFILE)
    model = profile.cost_model()
    if args.cost:
        model = model.with_overrides(cost_model.parse_cost_overrides(args.cost))
    kv_cache_config = None
    if args.model:
        _, sizing = _size_model(
            args,
            args.max_model_len,
            max_in_flight_tokens=args.max_num_batched_tokens,
            max_model_len_limit=profile.max_model_len,
        )
        kv_cache_config = sizing.kv_cache_config
        num_blocks = kv_cache_config.num_blocks - 1  # usable blocks: the null block aside
        max_model_len = sizing.max_model_len
    else:
        if args.capacity:
            capacities = parse_capacities(args.capacity, args.block_size)
            if len(capacities) != 1 or capacities[0] is None:
                raise _error("--mode serve takes one finite --capacity (a sweep is for replay)")
            num_blocks = capacities[0]
        else:
            num_blocks = profile.num_kv_blocks(args.block_size)
        max_model_len = args.max_model_len or min(
            profile.max_model_len, num_blocks * args.block_size
        )
    config = ServeConfig(
        num_blocks=num_blocks,
        cost_model=model,
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=max_model_len,
            enable_chunked_prefill=not args.no_chunked_prefill,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            async_caching=args.async_caching,
        ),
        block_size=args.block_size,
        max_model_len=max_model_len,
        policy=args.policy,
        time_scale=1.0 if args.time_scale is None else args.time_scale,
        enable_prefix_caching=not args.no_prefix_caching,
        watermark=args.watermark,
        hash_algorithm=args.hash_algorithm,
        kv_cache_config=kv_cache_config,
        **_eviction.serve_options(args, profile),
        hash_tokens=args.hash_tokens,
    )
    return config, profile.name if not args.cost else None


def _model_name(model: str) -> str:
    from pagedkv.sizing.model_config import load_model_description

    return load_model_description(model).name


def _model_groups(args: argparse.Namespace) -> tuple[str, Any]:
    """The model's name and KV-cache groups (no memory budget: the pool size comes elsewhere)."""
    from pagedkv.sizing import get_kv_cache_layout
    from pagedkv.sizing.model_config import load_model_description

    description = load_model_description(
        args.model, block_size=args.block_size, mamba_cache_mode="align"
    )
    return description.name, get_kv_cache_layout(description.layer_to_spec).groups


def _size_model(
    args: argparse.Namespace,
    max_model_len: int | None,
    *,
    max_in_flight_tokens: int | None,
    max_model_len_limit: int | None = None,
) -> tuple[str, Any]:
    """The model's name and `SizingResult` for `--memory`.

    With no `max_model_len`, the longest that fits the budget, up to `max_model_len_limit` and
    the model's max_position_embeddings (as the default path caps it by capacity).
    """
    from pagedkv.cli.size import parse_memory_bytes
    from pagedkv.sizing import estimate_max_model_len, get_kv_cache_layout, size_kv_cache
    from pagedkv.sizing.model_config import load_model_description

    memory_bytes = parse_memory_bytes(args.memory)
    description = load_model_description(
        args.model, block_size=args.block_size, mamba_cache_mode="align"
    )
    if max_model_len is None:
        limits = [
            limit
            for limit in (max_model_len_limit, description.max_position_embeddings)
            if limit is not None
        ]
        if not limits:
            raise _error(
                f"{description.source} names no max_position_embeddings: pass --max-model-len"
            )
        max_model_len = estimate_max_model_len(
            get_kv_cache_layout(description.layer_to_spec),
            memory_bytes,
            min(limits),
            max_in_flight_tokens=max_in_flight_tokens,
        )
        if max_model_len == 0:
            raise _error(f"--memory {args.memory} holds no request of {description.name}")
    sizing = size_kv_cache(
        description.layer_to_spec,
        memory_bytes,
        max_model_len,
        max_in_flight_tokens=max_in_flight_tokens,
    )
    return description.name, sizing


def _print_table(report_module: Any, the_report: dict, speed: Any) -> None:
    try:
        from rich.console import Console
    except ImportError:
        encoding = (getattr(sys.stdout, "encoding", None) or "").lower()
        ascii_only = "utf" not in encoding
        sys.stdout.write(report_module.render_text(the_report, speed, ascii_only=ascii_only))
        return
    # Piped or redirected: no terminal width to fit, so never wrap (rich would assume 80).
    width = None if sys.stdout.isatty() else _UNWRAPPED_WIDTH
    report_module.render_rich(the_report, speed, Console(width=width))


def _print_profiles(cost_model: Any) -> None:
    for name, profile in sorted(cost_model.PROFILES.items()):
        model = profile.cost_model()
        print(f"{name}: {profile.description}")
        print(
            f"  KV {profile.kv_bytes_per_token:,} bytes/token, "
            f"{profile.num_kv_blocks(16) * 16:,} KV tokens, max_model_len {profile.max_model_len:,}"
        )
        print(
            f"  step_overhead_s={model.step_overhead_s:.4g} prefill_token_s="
            f"{model.prefill_token_s:.4g} decode_seq_s={model.decode_seq_s:.4g} "
            f"kv_token_read_s={model.kv_token_read_s:.4g} "
            f"prefill_attention_pair_s={model.prefill_attention_pair_s:.4g}"
        )


class _Progress:
    """A rich progress bar on stderr, shown only once a run has lasted `_PROGRESS_DELAY_S`."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.start = time.monotonic()
        self.last_check = self.start
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, num_done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        # Hot path: called per request; look at the clock at most ten times a second.
        if now - self.last_check < 0.1:
            return
        self.last_check = now
        if self.bar is None:
            if now - self.start < _PROGRESS_DELAY_S:
                return
            try:
                from rich.console import Console
                from rich.progress import Progress
            except ImportError:
                self.enabled = False
                return
            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task(self.label, total=self.total, completed=num_done)
            self.bar.start()
            return
        self.bar.update(self.task, completed=num_done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
