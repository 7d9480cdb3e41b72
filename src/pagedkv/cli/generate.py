"""CLI: `pagedkv generate` runs a local transformers model on pagedkv's paged KV cache.

`--model` is a checkpoint directory, a `config.json` (random weights, seeded), or the name of a
config shipped in `pagedkv/data/models/` (`tiny-llama`). Needs the `[torch]` extra at run time.
Every argument is checked before the model is loaded; a mistake is one line on stderr and
exit status 2, Ctrl-C exits 130 (SIGTERM 143, SIGHUP 129).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pagedkv.credentials import redact

COMMAND = "generate"
HELP = "Generate tokens with a local Hugging Face model whose KV cache lives in pagedkv blocks."
EXAMPLES = (
    'pagedkv generate --model tiny-llama --block-size 4 --max-tokens 8 --prompt "10 11 12 13"',
    'pagedkv generate --model path/to/checkpoint --dtype bf16 --device cuda --prompt "Hello"',
)

_DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The spellings `pagedkv size` takes too (pagedkv.sizing.DTYPE_TO_BYTES), for the same dtypes.
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


def _dtype(text: str) -> str:
    """A dtype name, any of the shared spellings: float32/fp32, bfloat16/bf16, float16/fp16."""
    name = text.lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


_BACKENDS = ("auto", "sdpa", "triton", "reference")
_DEVICE_TYPES = ("cpu", "cuda", "mps")


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
    parser.add_argument(
        "--max-tokens", type=int, default=16, help="tokens to generate (default 16)"
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="do not stop at the model's EOS token(s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="weights (config only) and sampling")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy sampling (default 0)"
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probabilities add up to "
        "P (default 1: all)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default 16)"
    )
    parser.add_argument(
        "--num-blocks", type=int, default=None, help="KV blocks (default enough for the batch)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens one step computes, prompts chunked to fit (default 2048)",
    )
    parser.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV blocks of shared prompt prefixes",
    )
    parser.add_argument(
        "--hybrid-kv-cache",
        action="store_true",
        help="give sliding-window layers their own KV-cache group (blocks behind the window "
        "are freed) instead of managing a mixed model as full attention",
    )
    parser.add_argument(
        "--dtype",
        type=_dtype,
        choices=tuple(_DTYPES),
        default="float32",
        help="weights and KV cache: float32 (fp32), bfloat16 (bf16) or float16 (fp16) "
        "(default float32)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or mps (default cpu)")
    parser.add_argument(
        "--attention-backend",
        choices=_BACKENDS,
        default="auto",
        help="triton on a GPU when installed, else sdpa (default auto)",
    )
    parser.add_argument(
        "--no-cuda-graphs", action="store_true", help="run decode steps eagerly on a GPU"
    )
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


def run(args: argparse.Namespace) -> int:
    from pagedkv.errors import PagedKVError

    try:
        return _run(args)
    except PagedKVError as exc:
        print(f"pagedkv generate: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP
        from pagedkv.cli._shutdown import exit_code, interrupted, say

        say(f"pagedkv generate: {interrupted(exc)}")
        return exit_code(exc)


def check_arguments(args: argparse.Namespace) -> None:
    """Raise `InvalidArgumentError` for the first impossible number (standard library only)."""
    from pagedkv.errors import InvalidArgumentError

    positive = {
        "--max-tokens": args.max_tokens,
        "--block-size": args.block_size,
        "--max-num-batched-tokens": args.max_num_batched_tokens,
    }
    for flag, value in positive.items():
        if value < 1:
            raise InvalidArgumentError(f"{flag} must be a positive integer, got {value}")
    if args.num_blocks is not None and args.num_blocks < 2:
        raise InvalidArgumentError(
            f"--num-blocks must be at least 2 (one is the null block), got {args.num_blocks}"
        )
    if args.seed < 0:
        raise InvalidArgumentError(f"--seed must be >= 0, got {args.seed}")
    if not args.temperature >= 0.0:
        raise InvalidArgumentError(f"--temperature must be >= 0, got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise InvalidArgumentError(f"--top-p must be in (0, 1], got {args.top_p}")


def _import_extras():
    from pagedkv.errors import MissingDependencyError, install_hint

    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise MissingDependencyError(
            f"`pagedkv generate` needs PyTorch and transformers ({exc}): "
            f"install the [torch] extra, {install_hint('torch')}"
        ) from exc
    return torch


def check_device(torch, name: str):
    """The `torch.device` called `name`, if this machine and this torch build can use it."""
    from pagedkv.errors import InvalidArgumentError

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise InvalidArgumentError(
            f"--device {name!r} is not a device: give one of {', '.join(_DEVICE_TYPES)} "
            "(cuda:N for a GPU index)"
        ) from exc
    if device.type not in _DEVICE_TYPES:
        raise InvalidArgumentError(
            f"--device {name!r}: pagedkv generate runs on {', '.join(_DEVICE_TYPES)}"
        )
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise InvalidArgumentError(
                f"--device {name!r}: this torch build ({torch.__version__}) has no CUDA support"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index or 0) >= count:
            raise InvalidArgumentError(f"--device {name!r}: {count} CUDA device(s) visible")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"--device {name!r}: MPS is not available on this machine")
    return device


def _load_tokenizer(path: Path):
    """The checkpoint's tokenizer if its files are present locally, else None."""
    if not path.is_dir() or not any(
        (path / name).is_file()
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")
    ):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _parse_ids(prompt: str, vocab_size: int) -> list[int]:
    from pagedkv.errors import InvalidArgumentError

    parts = prompt.replace(",", " ").split()
    if not parts or not all(part.isdigit() for part in parts):
        raise InvalidArgumentError(
            f"prompt {prompt!r} is not token ids (the model has no local tokenizer): "
            "give ids like '1,2,3'"
        )
    ids = [int(part) for part in parts]
    outside = [token for token in ids if token >= vocab_size]
    if outside:
        raise InvalidArgumentError(
            f"prompt {prompt!r}: token ids {outside[:5]} are outside the model's vocabulary "
            f"[0, {vocab_size})"
        )
    return ids


def available_memory_bytes(torch, device) -> int:
    """Free memory on `device`: the GPU's free bytes, else the host's MemAvailable."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(config, num_blocks: int, args: argparse.Namespace, available: int) -> None:
    """Refuse (with the numbers) weights plus KV cache that would not fit in `available`."""
    from pagedkv.engine.model_runner import count_parameters
    from pagedkv.errors import NotEnoughMemoryError

    dtype_bytes = _DTYPES[args.dtype]
    weight_bytes = count_parameters(config) * dtype_bytes
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // config.num_attention_heads
    )
    num_kv_heads = config.num_key_value_heads or config.num_attention_heads
    page_bytes = 2 * args.block_size * num_kv_heads * head_dim * dtype_bytes
    kv_bytes = num_blocks * page_bytes * config.num_hidden_layers
    if weight_bytes + kv_bytes > available:
        gib = 2**30
        raise NotEnoughMemoryError(
            f"the model needs {weight_bytes / gib:.2f} GiB of weights and {num_blocks} KV blocks "
            f"need {kv_bytes / gib:.2f} GiB, but {args.device} has {available / gib:.2f} GiB "
            "available: lower --num-blocks or --max-tokens, or use a smaller --dtype"
        )


def _run(args: argparse.Namespace) -> int:
    check_arguments(args)
    torch = _import_extras()
    device = check_device(torch, args.device)
    from pagedkv.engine.engine import EngineConfig, LLMEngine
    from pagedkv.engine.model_runner import check_rope, load_config, load_model
    from pagedkv.engine.sampling import SamplingParams
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.specs import cdiv

    path = resolve_model_path(args.model)
    config = load_config(path)
    check_rope(config)
    tokenizer = None if args.token_ids else _load_tokenizer(path)
    if tokenizer is not None:
        prompts = [tokenizer.encode(prompt) for prompt in args.prompt]
    else:
        prompts = [_parse_ids(prompt, config.vocab_size) for prompt in args.prompt]
    max_len = max(len(p) for p in prompts) + args.max_tokens
    num_blocks = args.num_blocks
    if num_blocks is None:
        num_blocks = 1 + sum(cdiv(len(p) + args.max_tokens, args.block_size) for p in prompts)
    max_model_len = max(max_len, args.block_size)
    if args.num_blocks is not None and getattr(config, "sliding_window", None) is None:
        needed = cdiv(max_model_len, args.block_size)  # full attention: the whole sequence
        if num_blocks <= needed:
            raise InvalidArgumentError(
                f"--num-blocks {num_blocks}: the longest request ({max_model_len} tokens) needs "
                f"{needed} blocks of {args.block_size} tokens plus the null block"
            )
    check_memory(config, num_blocks, args, available_memory_bytes(torch, device))
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed if args.temperature > 0 else None,
    )
    engine_config = EngineConfig(
        block_size=args.block_size,
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        hybrid_kv_cache=args.hybrid_kv_cache,
        attention_backend=args.attention_backend,
        ignore_eos=args.ignore_eos,
        cuda_graphs=not args.no_cuda_graphs,
        seed=args.seed,
    )
    model = load_model(path, dtype=getattr(torch, args.dtype), device=device, seed=args.seed)
    engine = LLMEngine(model, engine_config)
    request_ids = [engine.add_request(prompt, params) for prompt in prompts]  # all checked first
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_invariants()
    return _report(args, engine, [engine.get_output(r) for r in request_ids], tokenizer)


def _report(args: argparse.Namespace, engine, outputs, tokenizer) -> int:
    results = []
    for output in outputs:
        result = {
            "request_id": output.request_id,
            "prompt_token_ids": list(output.prompt_token_ids),
            "output_token_ids": output.output_token_ids,
            "finish_reason": output.finish_reason,
            "num_cached_tokens": output.num_cached_tokens,
        }
        if tokenizer is not None:
            result["text"] = tokenizer.decode(output.output_token_ids)
        results.append(result)
    stats = engine.stats
    summary = {
        "num_blocks": engine.kv_cache_config.num_blocks,
        "block_size": args.block_size,
        "attention_backend": engine.runner.backend.name,
        "steps": stats.num_steps,
        "prefix_hit_tokens": stats.num_prefix_hit_tokens,
        "preemptions": stats.num_preemptions,
    }
    if args.json:
        print(json.dumps({"outputs": results, "stats": summary}))
        return 0
    for result in results:
        print(f"{result['request_id']}: prompt {result['prompt_token_ids']}")
        print(f"  -> {result['output_token_ids']} ({result['finish_reason']})")
        if "text" in result:
            print(f"  text: {result['text']!r}")
    counts = [
        (len(results), "request"),
        (summary["steps"], "step"),
        (summary["num_blocks"], "block"),
    ]
    done = ", ".join(f"{n} {noun}{'s' if n != 1 else ''}" for n, noun in counts)
    preemptions = summary["preemptions"]
    print(
        f"{done} of {args.block_size} tokens, {summary['prefix_hit_tokens']} prefix-hit tokens, "
        f"{preemptions} preemption{'s' if preemptions != 1 else ''} "
        f"({summary['attention_backend']} attention)"
    )
    return 0
