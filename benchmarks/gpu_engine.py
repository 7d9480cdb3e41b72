"""Engine benchmark (issues 6 and 15), run by hand on a GPU; prints JSON.

(a) attention: one decode token a sequence over a paged pool (bf16, 32 query / 8 KV heads,
    head size 128, 16-token blocks in random pool order) at 64 x 4,096, 256 x 1,024 and
    16 x 32,768: contiguous SDPA (the yardstick), gather + SDPA (the `sdpa` backend) and the
    Triton kernel (the `triton` backend); time, KV bandwidth, ratio to contiguous, max error.
    `--sweep` also times a grid of kernel tiles and reports the best per shape.
(b) decode: a Llama-3.1-8B-shaped bf16 model with random weights, the engine's decode step at
    batch 1, 64 and 256 with ~2k-token contexts (a shared prefix plus unique tails), with and
    without prefix caching: median step, its host split (scheduler, manager, forward), the
    graph replay alone, and the floors (weights read once; weights plus the KV read).
(d) host: building a decode step's block tables on the host at batch 256 x 2,048 tokens:
    whole tables read from the blocks and padded (before issue 15) vs per-request tables
    extended by new blocks and packed in CSR (`pack_step`), alternating, medians.
(c) equivalence: pagedkv greedy vs transformers on the same random weights (Llama-1B shape):
    float32 must match token for token; bfloat16 is teacher-forced (transformers' logits along
    pagedkv's tokens) and passes if every disagreement is within BF16_MARGIN logits of a tie.

    python benchmarks/gpu_engine.py                        # CUDA, everything
    python benchmarks/gpu_engine.py --only attention --sweep
    python benchmarks/gpu_engine.py --device cpu --tiny    # smoke run: tiny shapes, seconds
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import platform
import random
import statistics
import sys
import traceback
from time import perf_counter
from typing import Any

import torch
import torch.nn.functional as F
import transformers

from pagedkv.block import KVCacheBlock
from pagedkv.engine.attention import paged_attention_sdpa
from pagedkv.engine.attention_metadata import build_attention_metadata, pack_step
from pagedkv.engine.engine import EngineConfig, LLMEngine
from pagedkv.engine.sampling import SamplingParams
from pagedkv.specs import cdiv

LLAMA_8B = dict(  # Llama 3.1 8B shapes (RoPE scaling left out: it does not change the cost)
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, tie_word_embeddings=False,
)  # fmt: skip
LLAMA_1B = dict(  # Llama 3.2 1B shapes (default RoPE)
    hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
    num_key_value_heads=8, head_dim=64, vocab_size=128256, max_position_embeddings=8192,
    rope_theta=500000.0, tie_word_embeddings=True,
)  # fmt: skip
TINY = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=256, max_position_embeddings=512,
)  # fmt: skip
ATTENTION_SHAPES = {"full": [(64, 4096), (256, 1024), (16, 32768)], "tiny": [(2, 40), (3, 17)]}
DECODE: dict[str, dict[str, Any]] = {
    "full": dict(batches=(1, 64, 256), context=2048, tail=32, steps=24, chunk=8192),
    "tiny": dict(batches=(1, 4), context=64, tail=8, steps=4, chunk=64),
}
EQUIVALENCE: dict[str, dict[str, Any]] = {
    "full": dict(num_prompts=4, prompt_len=160, new_tokens=32),
    "tiny": dict(num_prompts=2, prompt_len=24, new_tokens=8),
}
BF16_MARGIN = 0.125  # logits: two bfloat16 ulps at magnitude 8..16
MANAGER_METHODS = (
    "get_computed_blocks", "allocate_slots", "free", "cache_blocks", "remove_skipped_blocks",
    "get_blocks", "get_block_ids", "get_num_common_prefix_blocks", "make_prefix_cache_stats",
    "record_prefix_cache_stats", "new_step_starts", "allocate_decode_slots",
)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of `fn()` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            started = perf_counter()
            fn()
            samples.append(1e3 * (perf_counter() - started))
    return statistics.median(samples)


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes a second a device-to-device copy moves (read plus write)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, iters=10)
    return 2 * num_bytes / (ms / 1e3)


# ------------------------------------------------------------------------------ (a) attention


def paged_pool(num_seqs, context, *, num_kv_heads, head_dim, block_size, dtype, device, seed):
    """Random K/V for `num_seqs` sequences of `context` tokens, blocks in random pool order."""
    blocks_per_seq = cdiv(context, block_size)
    num_blocks = 1 + num_seqs * blocks_per_seq
    order = list(range(1, num_blocks))
    random.Random(seed).shuffle(order)
    tables = [order[s * blocks_per_seq : (s + 1) * blocks_per_seq] for s in range(num_seqs)]
    generator = torch.Generator(device=device).manual_seed(seed)
    kv = torch.randn(
        (num_blocks, 2, block_size, num_kv_heads, head_dim),
        generator=generator, dtype=dtype, device=device,
    )  # fmt: skip
    kv[0].zero_()  # the null block
    return kv, tables


def contiguous_kv(kv, tables, context):
    """`[num_seqs, kv_heads, context, head_dim]` keys and values (what SDPA wants)."""
    index = torch.tensor(tables, device=kv.device)
    pages = kv[index]  # [seqs, blocks, 2, bs, kvh, d]
    num_seqs = len(tables)
    keys = pages[:, :, 0].reshape(num_seqs, -1, *kv.shape[3:])[:, :context]
    values = pages[:, :, 1].reshape(num_seqs, -1, *kv.shape[3:])[:, :context]
    return keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()


def attention_case(num_seqs, context, args, device, dtype, heads) -> dict:
    from pagedkv.engine import triton_attention

    num_heads, num_kv_heads, head_dim = heads
    kv, tables = paged_pool(
        num_seqs, context, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
        dtype=dtype, device=device, seed=args.seed,
    )  # fmt: skip
    metadata = build_attention_metadata(
        tables, [context - 1] * num_seqs, [1] * num_seqs, 16, device
    )
    query = torch.randn(num_seqs, num_heads, head_dim, dtype=dtype, device=device)
    keys, values = contiguous_kv(kv, tables, context)
    scale = head_dim**-0.5

    def contiguous():
        return F.scaled_dot_product_attention(
            query[:, :, None], keys, values, scale=scale, enable_gqa=True
        )[:, :, 0]

    def gathered():
        return paged_attention_sdpa(query, kv, metadata, scale)

    def triton(tiles=None):
        return triton_attention.paged_attention_triton(query, kv, metadata, scale, tiles=tiles)

    expected = contiguous().float()
    iters = args.iters if device.type == "cuda" else 2
    kv_bytes = 2 * num_seqs * context * num_kv_heads * head_dim * kv.element_size()
    result = {"batch": num_seqs, "context": context, "kv_bytes": kv_bytes}
    for name, fn in (
        ("contiguous_sdpa", contiguous),
        ("gather_sdpa", gathered),
        ("triton", triton),
    ):
        ms = time_ms(fn, device, iters)
        result[name] = {
            "ms": round(ms, 4),
            "kv_tb_per_s": round(kv_bytes / (ms / 1e3) / 1e12, 3),
            "max_abs_error": float((fn().float() - expected).abs().max()),
        }
    base = result["contiguous_sdpa"]["ms"]
    for name in ("gather_sdpa", "triton"):
        result[name]["x_contiguous"] = round(result[name]["ms"] / base, 3)
    result["tiles"] = vars(triton_attention.choose_tiles(metadata, num_heads, num_kv_heads, device))
    if args.sweep:
        result["sweep"] = sweep_tiles(triton, metadata, device, iters, base)
    return result


def sweep_tiles(triton, metadata, device, iters, base_ms) -> list[dict]:
    """Time a grid of decode tiles; the five fastest, with their ratio to contiguous SDPA."""
    from pagedkv.engine.triton_attention import KernelTiles

    timings = []
    for tile_n in (32, 64, 128):
        for num_splits in (1, 2, 4, 8, 16):
            for num_warps in (4, 8):
                for num_stages in (2, 3):
                    tiles = KernelTiles(1, 16, tile_n, num_splits, num_warps, num_stages)
                    ms = time_ms(functools.partial(triton, tiles), device, iters)
                    timings.append({**vars(tiles), "ms": round(ms, 4),
                                    "x_contiguous": round(ms / base_ms, 3)})  # fmt: skip
    return sorted(timings, key=lambda t: t["ms"])[:5]


def attention(args, device, tiny: bool) -> list[dict]:
    heads = (4, 2, 32) if tiny else (32, 8, 128)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    shapes = ATTENTION_SHAPES["tiny" if tiny else "full"]
    return [attention_case(b, c, args, device, dtype, heads) for b, c in shapes]


# ------------------------------------------------------------------------------ (b) decode


def build_model(shape: dict, dtype: torch.dtype, device: torch.device, seed: int):
    config = transformers.AutoConfig.for_model("llama", **shape)
    torch.manual_seed(seed)
    with device:  # initialise directly on the device
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None  # random weights: fixed-length runs
    model.generation_config.pad_token_id = 0
    return model.eval()


def random_prompt(rng: random.Random, num_tokens: int, vocab_size: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(num_tokens)]


def time_manager(engine: LLMEngine) -> dict[str, float]:
    """Wrap the manager's methods so outermost calls add their wall time to a counter."""
    manager = engine.kv_cache_manager
    state = {"depth": 0, "seconds": 0.0}
    # The scheduler also reads block tables straight from the coordinator.
    targets: list[tuple[object, str]] = [(manager, name) for name in MANAGER_METHODS]
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


def decode_case(model, batch: int, caching: bool, plan: dict, args, device) -> dict:
    """Fill `batch` requests to ~`context` tokens, then time the steps where all of them decode.

    Requests share a prefix and differ in their last `tail` prompt tokens. Early requests
    decode while later ones prefill, so each generates enough tokens to still be running when
    the last prefill ends; their contexts end at most at `context` tokens.
    """
    context, chunk = plan["context"], plan["chunk"]
    prefill_steps = cdiv(batch * context, chunk) + 2
    output_len = prefill_steps + plan["steps"] + 4
    prompt_len = context - output_len
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prefix = random_prompt(rng, prompt_len - plan["tail"], vocab)
    prompts = [prefix + random_prompt(rng, plan["tail"], vocab) for _ in range(batch)]
    config = EngineConfig(
        block_size=16, num_blocks=1 + batch * cdiv(context, 16), max_model_len=context,
        max_num_batched_tokens=chunk, max_num_seqs=batch, enable_prefix_caching=caching,
        attention_backend=args.attention_backend, cuda_graphs=not args.no_cuda_graphs,
        ignore_eos=True,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    manager_time = time_manager(engine)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=output_len))
    steps = []
    replay_ms = None
    while engine.has_unfinished_requests():
        stats = engine.stats
        before = (manager_time["seconds"], stats.schedule_s, stats.forward_s, stats.update_s)
        started = perf_counter()
        engine.step()
        sync(device)
        step_s = perf_counter() - started
        record = engine.scheduler.step_records[-1]
        if record.num_prefill_tokens == 0 and len(record.num_scheduled_tokens) == batch:
            after = (manager_time["seconds"], stats.schedule_s, stats.forward_s, stats.update_s)
            steps.append((step_s, *(a - b for a, b in zip(after, before, strict=True))))
            if len(steps) == 3 and engine.graphs is not None:
                # The buffers hold this full batch: replaying it rewrites the same K/V.
                replay_ms = time_ms(engine.graphs.replay_last, device, iters=10)
    measured = steps[2 : 2 + plan["steps"]]  # the first decode steps capture the graph
    if not measured:
        return {"batch": batch, "prefix_caching": caching, "error": "no full decode steps"}

    def median_ms(column: int) -> float:
        return round(1e3 * statistics.median(s[column] for s in measured), 4)

    result = {
        "batch": batch,
        "prefix_caching": caching,
        "attention_backend": engine.runner.backend.name,
        "cuda_graphs": engine.graphs is not None,
        "prompt_len": prompt_len,
        "num_decode_steps": len(measured),
        "step_ms": median_ms(0),
        "manager_ms": median_ms(1),
        "manager_fraction": round(sum(s[1] for s in measured) / sum(s[0] for s in measured), 5),
        "schedule_ms": median_ms(2),
        "forward_ms": median_ms(3),
        "update_ms": median_ms(4),
        "num_prefix_hit_tokens": engine.stats.num_prefix_hit_tokens,
    }
    if replay_ms is not None:
        result["graph_replay_ms"] = round(replay_ms, 4)
    return result


def decode(args, device, tiny: bool) -> dict:
    plan = DECODE["tiny" if tiny else "full"]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model = build_model(TINY if tiny else LLAMA_8B, dtype, device, args.seed)
    config = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = (
        2 * config.num_hidden_layers * config.num_key_value_heads
        * (getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        * torch.empty((), dtype=dtype).element_size()
    )  # fmt: skip
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 24))
    cases = []
    for batch in plan["batches"]:
        for caching in (True, False):
            case = functools.partial(decode_case, model, batch, caching, plan, args, device)
            cases.append(run_section(case, device))
    floors = {
        str(batch): {
            "weights_ms": round(1e3 * weight_bytes / bandwidth, 4),
            "weights_plus_kv_ms": round(
                1e3 * (weight_bytes + batch * plan["context"] * kv_bytes_per_token) / bandwidth, 4
            ),
        }
        for batch in plan["batches"]
    }
    return {
        "model": "tiny" if tiny else "llama-3.1-8b shape",
        "dtype": str(dtype).removeprefix("torch."),
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "copy_bandwidth_tb_per_s": round(bandwidth / 1e12, 3),
        "floors": floors,
        "cases": cases,
    }


# ------------------------------------------------------------------------------ (d) host


def host_tables(args, tiny: bool) -> dict:
    """Host time to turn a decode batch's block tables into one int tensor, two ways."""
    num_seqs, context, block_size = (8, 256, 16) if tiny else (256, 2048, 16)
    blocks_per_seq = context // block_size
    rng = random.Random(args.seed)
    ids = list(range(1, 1 + num_seqs * blocks_per_seq))
    rng.shuffle(ids)
    tables = [
        [KVCacheBlock(b) for b in ids[s * blocks_per_seq : (s + 1) * blocks_per_seq]]
        for s in range(num_seqs)
    ]
    rows = [[block.block_id for block in table] for table in tables]
    num_computed, num_new = [context - 1] * num_seqs, [1] * num_seqs

    def whole_tables_padded():  # what the engine did per step before
        block_ids = [[block.block_id for block in table] for table in tables]
        width = max(map(len, block_ids))
        return torch.tensor([row + [0] * (width - len(row)) for row in block_ids])

    def rows_packed():  # each request's row already extended; pack in CSR
        return pack_step(rows, num_computed, num_new, block_size).host

    samples: dict[str, list[float]] = {"whole_tables_padded": [], "rows_packed": []}
    for _ in range(args.iters):
        for name, fn in (
            ("whole_tables_padded", whole_tables_padded),
            ("rows_packed", rows_packed),
        ):
            started = perf_counter()
            fn()
            samples[name].append(1e3 * (perf_counter() - started))
    medians = {name: round(statistics.median(ms), 4) for name, ms in samples.items()}
    return {
        "batch": num_seqs,
        "context": context,
        "median_ms": medians,
        "ratio": round(medians["rows_packed"] / medians["whole_tables_padded"], 3),
    }


# ------------------------------------------------------------------------------ (c) equivalence


def equivalence(args, device, tiny: bool, dtype: torch.dtype) -> dict:
    """pagedkv greedy vs transformers on the same weights, in `dtype`."""
    plan = EQUIVALENCE["tiny" if tiny else "full"]
    model = build_model(TINY if tiny else LLAMA_1B, dtype, device, args.seed)
    rng = random.Random(args.seed)
    vocab, new_tokens = model.config.vocab_size, plan["new_tokens"]
    prompts = [
        random_prompt(rng, plan["prompt_len"] + 8 * i, vocab) for i in range(plan["num_prompts"])
    ]
    config = EngineConfig(
        block_size=16,
        num_blocks=1 + sum(cdiv(len(p) + new_tokens, 16) for p in prompts),
        max_model_len=max(map(len, prompts)) + new_tokens,
        attention_backend=args.attention_backend,
        cuda_graphs=not args.no_cuda_graphs,
        ignore_eos=True,
        record_logits=True,
    )
    outputs = LLMEngine(model, config).generate(prompts, SamplingParams(max_tokens=new_tokens))
    results: list[dict[str, Any]] = []
    for prompt, output in zip(prompts, outputs, strict=True):
        ours = output.output_token_ids
        with torch.no_grad():
            hf = model.generate(
                torch.tensor([prompt], device=device), do_sample=False, max_new_tokens=new_tokens
            )[0, len(prompt) :].tolist()
            # Teacher-forced: the model's own logits along pagedkv's tokens.
            logits = model(torch.tensor([prompt + ours], device=device)).logits
        logits = logits[0, len(prompt) - 1 : -1].float()
        ours_tensor = torch.tensor(ours, device=device)
        margin = logits.max(-1).values - logits.gather(1, ours_tensor[:, None])[:, 0]
        mismatch = [i for i, (a, b) in enumerate(zip(hf, ours, strict=True)) if a != b]
        results.append(
            {
                "prompt_len": len(prompt),
                "exact_match": not mismatch,
                "first_divergence": mismatch[0] if mismatch else None,
                "teacher_forced_top1_agreement": float(
                    (logits.argmax(-1) == ours_tensor).float().mean()
                ),
                "max_margin_where_disagree": float(margin.max()),
                "max_abs_logit_diff": float(
                    (torch.stack(output.logits).to(device) - logits).abs().max()
                ),
            }
        )
    if dtype == torch.float32:
        passed = all(r["exact_match"] for r in results)
        rule = "float32: every token equal to transformers' greedy output"
    else:
        passed = all(r["max_margin_where_disagree"] <= BF16_MARGIN for r in results)
        rule = f"bfloat16, teacher-forced: every pagedkv token within {BF16_MARGIN} logits of top-1"
    return {
        "dtype": str(dtype).removeprefix("torch."),
        "rule": rule,
        "passed": passed,
        "prompts": results,
    }


def run_section(run, device: torch.device):
    """The section's result, or its error (one failing section must not lose the others:
    a GPU run is rare)."""
    try:
        return run()
    except Exception as exc:  # reported in the JSON; the run goes on
        return {"error": repr(exc), "traceback": traceback.format_exc().splitlines()[-8:]}
    finally:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: a smoke run")
    parser.add_argument(
        "--only", choices=("attention", "decode", "equivalence", "host"), default=None
    )
    parser.add_argument("--sweep", action="store_true", help="(a): time a grid of kernel tiles")
    parser.add_argument("--attention-backend", default="auto", help="engine backend (auto)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="eager decode steps")
    parser.add_argument("--iters", type=int, default=50, help="timed runs per kernel (50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device (use --device cpu --tiny)")
    started = perf_counter()
    result: dict = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": describe_device(device),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "command": " ".join(["python benchmarks/gpu_engine.py", *(argv or sys.argv[1:])]),
    }
    try:
        import triton  # type: ignore[import-untyped]

        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    sections = {
        "attention": lambda: attention(args, device, args.tiny),
        "decode": lambda: decode(args, device, args.tiny),
        "host": lambda: host_tables(args, args.tiny),
        "equivalence": lambda: [
            equivalence(args, device, args.tiny, dtype) for dtype in (torch.float32, torch.bfloat16)
        ],
    }
    for name, run in sections.items():
        if args.only in (None, name):
            result[name] = run_section(run, device)
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
