"""CLI: `pagedkv generate` runs a local transformers model on pagedkv's paged KV cache.

`--model` is a checkpoint directory, a `config.json` (random weights, seeded), or the name of a
config shipped in `pagedkv/data/models/` (`tiny-llama`). Needs the `[torch]` extra at run time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

COMMAND = "generate"
HELP = "generate tokens with a local Hugging Face model whose KV cache lives in pagedkv blocks"

_DTYPES = ("float32", "bfloat16", "float16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint directory, config.json (random weights), or a shipped config name "
        "(tiny-llama)",
    )
    parser.add_argument(
        "--prompt",
        action="append",
        required=True,
        help="prompt text (if the model has a local tokenizer) or token ids like '1,2,3'; "
        "repeat for a batch",
    )
    parser.add_argument("--token-ids", action="store_true", help="prompts are token ids")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (16)")
    parser.add_argument("--seed", type=int, default=0, help="weights (config only) and sampling")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--block-size", type=int, default=16, help="tokens a KV block (16)")
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default: enough for the batch)"
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument(
        "--hybrid-kv-cache",
        action="store_true",
        help="give sliding-window layers their own KV-cache group (blocks behind the window "
        "are freed) instead of managing a mixed model as full attention",
    )
    parser.add_argument("--dtype", choices=_DTYPES, default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def resolve_model_path(name: str) -> Path:
    """A filesystem path, else a config shipped under `pagedkv/data/models/<name>/`."""
    path = Path(name)
    if path.exists():
        return path
    shipped = Path(__file__).resolve().parent.parent / "data" / "models" / name
    if (shipped / "config.json").is_file():
        return shipped
    from pagedkv.errors import InvalidArgumentError

    raise InvalidArgumentError(f"--model {name!r} is neither a path nor a shipped model config")


def _load_tokenizer(path: Path):
    """The checkpoint's tokenizer if its files are present locally, else None."""
    if not path.is_dir() or not any(
        (path / name).is_file()
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _parse_ids(prompt: str) -> list[int]:
    from pagedkv.errors import InvalidArgumentError

    parts = prompt.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        raise InvalidArgumentError(
            f"prompt {prompt!r} is not token ids (the model has no local tokenizer): "
            "give ids like '1,2,3'"
        )
    return [int(part) for part in parts]


def run(args: argparse.Namespace) -> int:
    from pagedkv.errors import PagedKVError

    try:
        return _run(args)
    except PagedKVError as exc:
        print(f"pagedkv generate: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    import torch

    from pagedkv.engine.engine import EngineConfig, LLMEngine
    from pagedkv.engine.model_runner import load_model
    from pagedkv.engine.sampling import SamplingParams
    from pagedkv.specs import cdiv

    path = resolve_model_path(args.model)
    tokenizer = None if args.token_ids else _load_tokenizer(path)
    if tokenizer is not None:
        prompts = [tokenizer.encode(prompt) for prompt in args.prompt]
    else:
        prompts = [_parse_ids(prompt) for prompt in args.prompt]
    model = load_model(path, dtype=getattr(torch, args.dtype), device=args.device, seed=args.seed)
    max_len = max(len(p) for p in prompts) + args.max_tokens
    num_blocks = args.num_blocks
    if num_blocks is None:
        num_blocks = 1 + sum(cdiv(len(p) + args.max_tokens, args.block_size) for p in prompts)
    config = EngineConfig(
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_model_len=max(max_len, args.block_size),
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        hybrid_kv_cache=args.hybrid_kv_cache,
        seed=args.seed,
    )
    engine = LLMEngine(model, config)
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed if args.temperature > 0 else None,
    )
    outputs = engine.generate(prompts, params)
    engine.check_invariants()
    stats = engine.stats
    results = []
    for output in outputs:
        result = {
            "request_id": output.request_id,
            "prompt_token_ids": list(output.prompt_token_ids),
            "output_token_ids": output.output_token_ids,
            "num_cached_tokens": output.num_cached_tokens,
        }
        if tokenizer is not None:
            result["text"] = tokenizer.decode(output.output_token_ids)
        results.append(result)
    summary = {
        "num_blocks": num_blocks,
        "block_size": args.block_size,
        "steps": stats.num_steps,
        "prefix_hit_tokens": stats.num_prefix_hit_tokens,
        "preemptions": stats.num_preemptions,
    }
    if args.json:
        print(json.dumps({"outputs": results, "stats": summary}))
        return 0
    for result in results:
        print(f"{result['request_id']}: prompt {result['prompt_token_ids']}")
        print(f"  -> {result['output_token_ids']}")
        if "text" in result:
            print(f"  text: {result['text']!r}")
    print(
        f"{len(results)} requests, {summary['steps']} steps, {num_blocks} blocks of "
        f"{args.block_size} tokens, {summary['prefix_hit_tokens']} prefix-hit tokens, "
        f"{summary['preemptions']} preemptions"
    )
    return 0
