"""Where the time goes inside vLLM: vLLM 0.33's own `Scheduler` with its own KV-cache manager and
with pagedkv's, same process, same workload. Run by hand in a venv with vLLM 0.33 (the `[vllm]`
extra, or .ci/vllm-suites' .vllm-ci/venv); prints a Markdown table and one JSON line.

No model: the loop is `schedule()` then `update_from_output()` with one synthetic token a running
request (as vLLM's own tests drive it). N requests with 512-token prompts (the first 256 tokens
shared, so later admissions hit the prefix cache) are admitted and prefilled; then the decode
steps with all N running are timed. The managers alternate run by run (A/B/A/B...) and medians
are reported. A second, instrumented pass times every manager call, for the manager's share.

    python benchmarks/vllm_scheduler.py [--requests 64 256 1024] [--steps 40] [--repeats 3]
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
from pathlib import Path
from time import perf_counter
from typing import Any

PROMPT_TOKENS = 512
SHARED_PREFIX_TOKENS = 256
BLOCK_SIZE = 16
# Manager methods the scheduler calls in this loop (timed in the instrumented pass).
TIMED_METHODS = (
    "allocate_slots",
    "get_computed_blocks",
    "get_computed_blocks_for_connector",
    "get_blocks",
    "get_block_ids",
    "free",
    "pop_blocks_for_free",
    "cache_blocks",
    "new_step_starts",
    "take_events",
    "take_new_block_ids",
    "take_kv_cache_block_copies",
    "take_boundary_state_offloads",
    "record_prefix_cache_stats",
    "make_prefix_cache_stats",
    "estimate_cached_tokens",
    "remove_skipped_blocks",
)


def model_dir() -> str:
    """A config-only facebook/opt-125m stand-in (transformers' OPTConfig defaults)."""
    from transformers import OPTConfig

    path = Path(tempfile.mkdtemp(prefix="opt125m-"))
    config = OPTConfig(architectures=["OPTForCausalLM"])
    config.save_pretrained(path)
    return str(path)


def make_scheduler(scheduler_cls: type, model: str, num_requests: int) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    max_model_len = 2048  # opt-125m's
    num_blocks = num_requests * 48 + 1024  # every request past 700 tokens, with room
    model_config = ModelConfig(
        model=model, skip_tokenizer_init=True, dtype="float16", max_model_len=max_model_len
    )
    scheduler_config = SchedulerConfig(
        max_num_seqs=num_requests,
        max_num_batched_tokens=8192,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cache_config.num_gpu_blocks = num_blocks
    vllm_config = VllmConfig(
        scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config
    )
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    register_all_kvcache_specs(vllm_config)
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK_SIZE,
        log_stats=True,
    )


def make_requests(num_requests: int) -> list:
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    shared = list(range(SHARED_PREFIX_TOKENS))
    requests = []
    for i in range(num_requests):
        suffix = [(i * 7919 + j) % 50000 + 1000 for j in range(PROMPT_TOKENS - len(shared))]
        params = SamplingParams(max_tokens=3000, ignore_eos=True)
        requests.append(Request(str(i), shared + suffix, params, None, block_hasher=hasher))
    return requests


def model_output(scheduler: Any, scheduler_output: Any) -> Any:
    """One sampled token per request whose prompt is done (a prefill chunk samples none)."""
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(scheduler_output.num_scheduled_tokens)
    requests = scheduler.requests
    sampled = [
        [7] if requests[r].num_computed_tokens >= requests[r].num_tokens else [] for r in req_ids
    ]
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=sampled,
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=[],
    )


def instrument(manager: Any) -> dict[str, float]:
    """Wrap the manager's methods (on the instance) to sum their time; returns the sums."""
    spent = {"seconds": 0.0}
    for name in TIMED_METHODS:
        method = getattr(manager, name, None)
        if method is None:
            continue

        def timed(*args: Any, _method: Any = method, **kwargs: Any) -> Any:
            start = perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                spent["seconds"] += perf_counter() - start

        setattr(manager, name, timed)
    return spent


def run(scheduler_cls: type, model: str, num_requests: int, num_steps: int, timed: bool) -> dict:
    """Prefill N requests, then time `num_steps` decode steps with all N running."""
    scheduler = make_scheduler(scheduler_cls, model, num_requests)
    for request in make_requests(num_requests):
        scheduler.add_request(request)
    while scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
    ):
        output = scheduler.schedule()
        scheduler.update_from_output(output, model_output(scheduler, output))
    assert len(scheduler.running) == num_requests
    spent = instrument(scheduler.kv_cache_manager) if timed else {"seconds": 0.0}
    gc.collect()
    start = perf_counter()
    for _ in range(num_steps):
        output = scheduler.schedule()
        scheduler.update_from_output(output, model_output(scheduler, output))
    elapsed = perf_counter() - start
    return {
        "ms_per_step": 1000 * elapsed / num_steps,
        "manager_share": spent["seconds"] / elapsed if timed else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    # No accelerator, no network: vLLM's CPU platform and a local model config.
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import vllm
    from vllm.v1.core.sched.scheduler import Scheduler as VllmScheduler

    from pagedkv.integrations.vllm import Scheduler as PagedKVScheduler

    model = model_dir()
    schedulers = {"vllm": VllmScheduler, "pagedkv": PagedKVScheduler}
    results: dict[int, dict[str, dict[str, float]]] = {}  # per size: each manager, the ratio
    for num_requests in args.requests:
        times: dict[str, list[float]] = {name: [] for name in schedulers}
        for _ in range(args.repeats):
            for name, scheduler_cls in schedulers.items():  # alternate A/B
                times[name].append(
                    run(scheduler_cls, model, num_requests, args.steps, False)["ms_per_step"]
                )
        shares = {
            name: run(scheduler_cls, model, num_requests, args.steps, True)["manager_share"]
            for name, scheduler_cls in schedulers.items()
        }
        results[num_requests] = {
            name: {"ms_per_step": statistics.median(times[name]), "manager_share": shares[name]}
            for name in schedulers
        }
        # The spread: each repeat's pair (run back to back) gives one ratio.
        ratios = [ours / ref for ours, ref in zip(times["pagedkv"], times["vllm"], strict=True)]
        results[num_requests]["ratio"] = {
            "median": statistics.median(ratios),
            "min": min(ratios),
            "max": max(ratios),
        }
    print(
        "| running requests | vLLM's manager: ms/step | its share | pagedkv: ms/step | its share"
        " | step time pagedkv / vLLM (median of the repeats' ratios, min-max) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for num_requests, result in results.items():
        reference, ours = result["vllm"], result["pagedkv"]
        print(
            f"| {num_requests:,} | {reference['ms_per_step']:.2f} | "
            f"{100 * reference['manager_share']:.0f}% | {ours['ms_per_step']:.2f} | "
            f"{100 * ours['manager_share']:.0f}% | "
            f"{result['ratio']['median']:.2f} ({result['ratio']['min']:.2f}-"
            f"{result['ratio']['max']:.2f}) |"
        )
    print(
        json.dumps(
            {
                "vllm": vllm.__version__,
                "python": platform.python_version(),
                "steps": args.steps,
                "repeats": args.repeats,
                "results": results,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
