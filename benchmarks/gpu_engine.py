"""Engine benchmark (issue 6), run by hand on a GPU; prints JSON.

(a) equivalence: a Llama-1B-shaped random model in bf16; pagedkv greedy vs transformers'
    `generate` (exact token match, first divergence, teacher-forced top-1 agreement and the
    logit margin where they disagree, prefill logit difference).
(b) throughput: a shared-prefix workload (one system prompt + unique suffixes), output and
    total tokens per second with and without prefix caching.
(c) manager CPU time per decode step (KVCacheManager calls, timed around the scheduler's
    calls) as a fraction of the step; the scheduler's whole host time too.

    python benchmarks/gpu_engine.py                      # CUDA, Llama-1B shape, bf16
    python benchmarks/gpu_engine.py --device cpu --tiny  # smoke run: tiny model, float32
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import platform
import random
import statistics
import sys
from time import perf_counter

import torch
import transformers

from pagedkv.engine.engine import EngineConfig, LLMEngine
from pagedkv.engine.sampling import SamplingParams
from pagedkv.specs import cdiv

LLAMA_1B = dict(  # Llama 3.2 1B shapes (default RoPE, no scaling)
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=512,
)
FULL_WORKLOAD = dict(
    num_eq_prompts=4, eq_prompt_len=160, eq_new_tokens=32,
    num_requests=64, prefix_len=1024, suffix_len=64, output_len=128,
    block_size=16, max_num_batched_tokens=8192, max_num_seqs=64,
)  # fmt: skip
TINY_WORKLOAD = dict(
    num_eq_prompts=2, eq_prompt_len=24, eq_new_tokens=8,
    num_requests=8, prefix_len=48, suffix_len=8, output_len=16,
    block_size=16, max_num_batched_tokens=256, max_num_seqs=8,
)  # fmt: skip

MANAGER_METHODS = (
    "get_computed_blocks",
    "allocate_slots",
    "free",
    "cache_blocks",
    "remove_skipped_blocks",
    "get_blocks",
    "get_block_ids",
    "get_num_common_prefix_blocks",
    "make_prefix_cache_stats",
    "record_prefix_cache_stats",
    "new_step_starts",
    "allocate_decode_slots",
)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, seed: int):
    config = transformers.AutoConfig.for_model("llama", **shape)
    torch.manual_seed(seed)
    with device:  # initialise directly on the device
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.pad_token_id = 0
    return model.eval()


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def engine_for(model, workload: dict, num_blocks: int, **overrides) -> LLMEngine:
    config = EngineConfig(
        block_size=workload["block_size"],
        num_blocks=num_blocks,
        max_model_len=workload["prefix_len"] + workload["suffix_len"] + workload["output_len"] + 1,
        max_num_batched_tokens=workload["max_num_batched_tokens"],
        max_num_seqs=workload["max_num_seqs"],
        **overrides,
    )
    return LLMEngine(model, config)


def equivalence(model, workload: dict, device: torch.device, rng: random.Random) -> dict:
    """pagedkv greedy vs transformers greedy on the same weights."""
    vocab = model.config.vocab_size
    new_tokens = workload["eq_new_tokens"]
    prompts = [
        random_prompt(rng, workload["eq_prompt_len"] + 8 * i, vocab)
        for i in range(workload["num_eq_prompts"])
    ]
    num_blocks = 1 + sum(cdiv(len(p) + new_tokens, workload["block_size"]) for p in prompts)
    engine = engine_for(model, {**workload, "prefix_len": max(map(len, prompts))}, num_blocks,
                        record_logits=True)  # fmt: skip
    outputs = engine.generate(prompts, SamplingParams(max_tokens=new_tokens))
    results = []
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt], device=device),
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
            )[0, len(prompt) :].tolist()
            # Teacher-forced: the model's own logits along pagedkv's tokens.
            sequence = torch.tensor([prompt + output.output_token_ids], device=device)
            logits = model(sequence).logits[0, len(prompt) - 1 : -1].float()
        ours = torch.tensor(output.output_token_ids, device=device)
        top1 = logits.argmax(-1)
        margin = logits.max(-1).values - logits.gather(1, ours[:, None])[:, 0]
        pairs = zip(hf, output.output_token_ids, strict=True)
        mismatch = [i for i, (a, b) in enumerate(pairs) if a != b]
        results.append(
            {
                "prompt_len": len(prompt),
                "exact_match": not mismatch,
                "first_divergence": mismatch[0] if mismatch else None,
                "teacher_forced_top1_agreement": float((top1 == ours).float().mean()),
                "max_margin_where_disagree": float(margin.max()),
                "prefill_max_abs_logit_diff": float(
                    (output.logits[0].to(device) - logits[0]).abs().max()
                ),
            }
        )
    return {
        "new_tokens": new_tokens,
        "num_exact": sum(r["exact_match"] for r in results),
        "prompts": results,
    }


def time_manager(engine: LLMEngine) -> dict[str, float]:
    """Wrap the manager's methods so outermost calls add their wall time to a counter."""
    manager = engine.kv_cache_manager
    state = {"depth": 0, "seconds": 0.0}
    # The scheduler also reads block tables straight from the coordinator.
    targets = [(manager, name) for name in MANAGER_METHODS]
    targets.append((manager.coordinator, "get_blocks"))
    for owner, name in targets:
        method = getattr(owner, name, None)
        if method is None:
            continue

        @functools.wraps(method)
        def timed(*args, _method=method, **kwargs):
            if state["depth"]:
                return _method(*args, **kwargs)
            state["depth"] = 1
            started = perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                state["seconds"] += perf_counter() - started
                state["depth"] = 0

        setattr(owner, name, timed)
    return state


def throughput(model, workload: dict, device: torch.device, caching: bool, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    prefix = random_prompt(rng, workload["prefix_len"], vocab)
    prompts = [
        prefix + random_prompt(rng, workload["suffix_len"], vocab)
        for _ in range(workload["num_requests"])
    ]
    per_request = cdiv(len(prompts[0]) + workload["output_len"], workload["block_size"])
    num_blocks = 1 + per_request * workload["num_requests"]  # the same pool either way
    engine = engine_for(model, workload, num_blocks, enable_prefix_caching=caching)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2))  # warm-up (kernels, allocator)
    if caching:
        engine.kv_cache_manager.reset_prefix_cache()
    manager_time = time_manager(engine)
    params = SamplingParams(max_tokens=workload["output_len"])
    for prompt in prompts:
        engine.add_request(prompt, params)
    decode_steps = []
    first_step = len(engine.scheduler.step_records)
    sync(device)
    started = perf_counter()
    while engine.has_unfinished_requests():
        manager_before, sched_before = manager_time["seconds"], _host(engine)
        step_started = perf_counter()
        engine.step()
        sync(device)
        step_s = perf_counter() - step_started
        record = engine.scheduler.step_records[-1]
        if record.num_prefill_tokens == 0:
            decode_steps.append(
                (step_s, manager_time["seconds"] - manager_before, _host(engine) - sched_before)
            )
    elapsed = perf_counter() - started
    records = engine.scheduler.step_records[first_step:]
    num_output = workload["num_requests"] * workload["output_len"]
    num_prompt = sum(map(len, prompts))
    step_s = [s for s, _, _ in decode_steps]
    manager_s = [m for _, m, _ in decode_steps]
    host_s = [h for _, _, h in decode_steps]
    return {
        "prefix_caching": caching,
        "num_blocks": num_blocks,
        "seconds": round(elapsed, 4),
        "output_tokens_per_s": round(num_output / elapsed, 1),
        "total_tokens_per_s": round((num_output + num_prompt) / elapsed, 1),
        "num_steps": len(records),
        "num_prefill_tokens_computed": sum(r.num_prefill_tokens for r in records),
        "num_prefix_hit_tokens": sum(r.num_prefix_hit_tokens for r in records),
        "num_preemptions": sum(len(r.preempted_request_ids) for r in records),
        "decode_steps": {
            "count": len(decode_steps),
            "median_step_ms": round(1e3 * statistics.median(step_s), 3) if step_s else None,
            "median_manager_ms": round(1e3 * statistics.median(manager_s), 4) if step_s else None,
            "manager_fraction": round(sum(manager_s) / sum(step_s), 5) if step_s else None,
            "scheduler_host_fraction": round(sum(host_s) / sum(step_s), 5) if step_s else None,
        },
    }


def _host(engine: LLMEngine) -> float:
    """Scheduler host time so far (schedule() + update_from_output(), manager included)."""
    return engine.stats.schedule_s + engine.stats.update_s


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny model and workload")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", choices=("equivalence", "throughput"), default=None)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("float32" if device.type == "cpu" else "bfloat16")
    dtype = getattr(torch, dtype_name)
    shape, workload = (TINY, TINY_WORKLOAD) if args.tiny else (LLAMA_1B, FULL_WORKLOAD)
    started = perf_counter()
    model = build_model(shape, dtype, device, args.seed)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = platform.processor() or "cpu"
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": {"shape": "tiny" if args.tiny else "llama-1b", "dtype": dtype_name,
                  "num_parameters": sum(p.numel() for p in model.parameters())},
        "workload": workload,
        "model_init_s": round(perf_counter() - started, 2),
    }  # fmt: skip
    if args.only in (None, "equivalence"):
        result["equivalence"] = equivalence(model, workload, device, random.Random(args.seed))
    if args.only in (None, "throughput"):
        result["throughput"] = [
            throughput(model, workload, device, caching, args.seed) for caching in (False, True)
        ]
    if device.type == "cuda":
        result["max_memory_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    result["total_s"] = round(perf_counter() - started, 2)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
