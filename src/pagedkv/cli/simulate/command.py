"""CLI: the `pagedkv simulate` command: parse, check, call the mode, print its report.

With no arguments it serves the Mooncake sample shipped in the package and prints a report.
Imports only the standard library at module level.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

from pagedkv.cli._shutdown import StopOnSignal
from pagedkv.cli.simulate import checks, cluster, eviction, memory, sweep
from pagedkv.cli.simulate.args import add_arguments, resolve_mode
from pagedkv.cli.simulate.progress import Progress
from pagedkv.credentials import redact

COMMAND = "simulate"
HELP = "Simulate a request trace: prefix-cache hit rate, memory, preemptions, latency."
EXAMPLES = (
    "pagedkv simulate                          # the memory study of the shipped trace",
    "pagedkv simulate --trace my_trace.jsonl --capacity 50k,100k,200k",
    "pagedkv simulate --mode serve --time-scale 4 --plot serve.png",
    "pagedkv simulate --mode replay --capacity 20k,1M,unlimited --eviction all",
    "pagedkv simulate --workload chat --instances 4 --routing-policy all",
)

SAMPLE_TRACE = "mooncake_conversation_sample.jsonl"


def run(args: argparse.Namespace) -> int:
    from pagedkv.errors import PagedKVError

    try:
        return _run(args)
    except PagedKVError as exc:
        print(f"pagedkv simulate: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        raise  # `pagedkv.cli.main`'s: quiet, exit 141
    except OSError as exc:
        print(f"pagedkv simulate: error: {redact(str(exc))}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    from pagedkv.sim import cost_model
    from pagedkv.sim.report import render_profiles

    if args.list_profiles:
        sys.stdout.write(render_profiles())
        return 0
    mode_given = args.mode is not None
    args.mode = resolve_mode(args)
    sweep.normalize(args, _error, mode_given)
    sweep.check(args, _error)  # first: a missing extra is named before any work
    if args.output:
        from pagedkv.sim.report.results import output_format

        output_format(args.output)
        if cluster.wanted(args):
            raise _error("--output is not supported with a cluster (--instances) yet")
    if args.mode == "memory" and not (args.trace or args.workload or args.num_requests):
        args.num_requests = memory.DEFAULT_NUM_REQUESTS  # a few seconds for the whole study
    if args.mode != "memory" and args.time_scale is None:
        args.time_scale = 1.0  # the memory study picks its own load when none is given
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
    if args.model and cluster.wanted(args):
        raise _error("--model is not supported with a cluster (--instances) yet")
    eviction.check(args, _error)
    if eviction.wanted(args) and cluster.wanted(args):
        raise _error("--eviction and --host-capacity are not supported with a cluster yet")
    checks.check_simulate_args(args, cost_model, cluster=cluster.wanted(args))
    if cluster.wanted(args):
        cluster.preflight(args)
    show_progress = not (args.json or args.no_progress) and sys.stderr.isatty()

    def make_progress(total: int, label: str) -> Progress:
        return Progress(total, label, show_progress)

    if sweep.wanted(args):
        return _sweep(args, cost_model, make_progress)
    trace = _load(args)
    checks.check_simulate_trace(args, trace)
    # The first Ctrl-C (or SIGTERM, SIGHUP) ends a serve run early; the report shows what it
    # measured and the exit code says which signal stopped it.
    stop = StopOnSignal()
    if cluster.wanted(args):
        config, profile_name = _serve_config(args, cost_model)
        return cluster.run(args, trace, config, profile_name, make_progress, stop)
    plot = None
    if args.mode == "memory":
        the_report, speed = memory.run(
            args, trace, cost_model, _serve_config, make_progress, _max_workers(args)
        )
    elif args.mode == "replay" and eviction.wanted(args):
        the_report, speed, plot = eviction.replay(args, trace, make_progress)
    elif args.mode == "replay":
        the_report, speed, plot = _replay(args, trace, show_progress)
    else:
        the_report, speed, plot = _serve(args, trace, cost_model, show_progress, stop)
    _print(args, the_report, speed)
    if args.plot and plot is not None:
        plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    interrupted = args.mode == "serve" and the_report["results"].get("interrupted", False)
    return stop.exit_code() if interrupted else 0


def _print(args: argparse.Namespace, the_report: dict[str, Any], speed: Any) -> None:
    """The report (table or JSON, the speed on stderr with JSON), and the --output file."""
    from pagedkv.sim.report import print_report, to_json

    if args.json:
        sys.stdout.write(to_json(the_report))
        steps = f", {speed.steps_per_s:,.0f} steps/s" if speed.num_steps else ""
        print(
            f"simulated {speed.num_prompt_tokens_simulated:,} prompt tokens in "
            f"{speed.wall_s:.1f} s ({speed.prompt_tokens_per_s:,.0f} tokens/s{steps})",
            file=sys.stderr,
        )
    else:
        print_report(the_report, speed)
    if args.output:
        from pagedkv.sim.report.results import write_results

        num_rows = write_results(args.output, the_report, ["pagedkv", *sys.argv[1:]])
        print(f"wrote {args.output} ({num_rows:,} rows)", file=sys.stderr)


def _sweep(args: argparse.Namespace, cost_model: Any, make_progress: Any) -> int:
    """A grid of cells, run by the chosen executor; one report for all."""
    from pagedkv.sim.report import Speed

    traces = []
    for path in args.traces or [None]:
        trace = _load(argparse.Namespace(**{**vars(args), "trace": path}))
        checks.check_simulate_trace(argparse.Namespace(**{**vars(args), "trace": path}), trace)
        traces.append(trace)

    def serve_config(cell_args: argparse.Namespace) -> Any:
        return _serve_config(cell_args, cost_model)

    grid = sweep.cells(args, traces, serve_config)
    executor = sweep.make_executor(args, _max_workers(args))
    the_report, wall_s, num_tokens = sweep.run(args, traces, grid, executor, make_progress)
    _print(args, the_report, Speed(wall_s, num_tokens))
    return 0


def _error(message: str) -> Exception:
    from pagedkv.errors import InvalidArgumentError

    return InvalidArgumentError(message)


def _load(args: argparse.Namespace) -> Any:
    from pagedkv.sim.inputs.traces import TraceWarning, load_trace
    from pagedkv.sim.inputs.workloads import WorkloadParams, make_workload

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
    progress = Progress(len(trace.requests), "replaying", show_progress)
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
        from pagedkv.sim.report.plot import plot_replay

        plot_replay(the_report, path)

    return the_report, speed, plot


def _max_workers(args: argparse.Namespace) -> int:
    from pagedkv.sim.processes import default_max_workers

    if args.jobs is None:
        return default_max_workers()
    if args.jobs < 1:
        raise _error(f"--jobs must be >= 1, got {args.jobs}")
    return args.jobs


def _serve(
    args: argparse.Namespace,
    trace: Any,
    cost_model: Any,
    show_progress: bool,
    stop: StopOnSignal,
) -> tuple:
    from pagedkv.sim.report import Speed, serve_report
    from pagedkv.sim.serve import simulate_serving

    config, profile_name = _serve_config(args, cost_model)
    options = sweep.vllm_options(args)
    if options is not None:
        from pagedkv.sim.vllm_options import check_supported

        check_supported(config)  # before vLLM's import (seconds)
    progress = Progress(len(trace.requests), "serving", show_progress)
    start = time.perf_counter()
    try:
        with stop:
            if options is None:
                result = simulate_serving(trace, config, progress, stop)
            else:
                from pagedkv.sim.vllm_serve import simulate_serving_vllm

                result = simulate_serving_vllm(trace, config, options, progress, stop)
    finally:
        progress.close()
    wall_s = time.perf_counter() - start
    speed = Speed(wall_s, result.summary["tokens"]["prompt"], result.summary["num_steps"])
    model_name = _model_name(args.model) if args.model else None
    the_report = serve_report(trace, config, profile_name, result, model_name)
    if options is not None:
        the_report["config"]["vllm_scheduler"] = {
            "kv_manager": options.kv_manager,
            "async_scheduling": options.async_scheduling,
        }

    def plot(path: str) -> None:
        from pagedkv.sim.report.plot import plot_serve

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
        time_scale=args.time_scale,
        enable_prefix_caching=not args.no_prefix_caching,
        watermark=args.watermark,
        hash_algorithm=args.hash_algorithm,
        kv_cache_config=kv_cache_config,
        **eviction.serve_options(args, profile),
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


__all__ = ["COMMAND", "HELP", "add_arguments", "run"]
