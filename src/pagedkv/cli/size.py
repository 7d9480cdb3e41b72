"""CLI: `pagedkv size` — how many KV-cache blocks a model gets from a memory budget.

Reads a Hugging Face `config.json` (a path, a model directory or a shipped name such as
`llama-3.1-8b`), groups the layers, and prints the groups, bytes per block, `num_blocks`,
token capacity and max concurrency. Errors exit 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from fractions import Fraction
from typing import Any

from pagedkv.credentials import redact

COMMAND = "size"
HELP = "Size the KV cache: groups, block and page sizes, num_blocks, capacity, concurrency."
EXAMPLES = (
    "pagedkv size --model llama-3.1-8b --memory 80GiB --max-model-len 32768",
    "pagedkv size --model path/to/config.json --memory 20GiB --dtype bf16 --json",
)

# Matches the reference scheduler's default `max_num_batched_tokens`.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192

_UNIT_TO_BYTES = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_MEMORY_PATTERN = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_memory_bytes(text: str) -> int:
    """Bytes in `80GiB`, `80GB`, `512MiB`, `1.5TiB` or plain `1073741824` (rounded down)."""
    from pagedkv.errors import InvalidArgumentError

    match = _MEMORY_PATTERN.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNIT_TO_BYTES:
        raise InvalidArgumentError(
            f"--memory {text!r}: expected a number with an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 80GiB"
        )
    num_bytes = int(Fraction(match.group(1)) * _UNIT_TO_BYTES[unit])
    if num_bytes <= 0:
        raise InvalidArgumentError(f"--memory {text!r}: must be more than 0 bytes")
    return num_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        "--config",  # the older name, kept
        dest="config",
        metavar="NAME_OR_CONFIG",
        required=True,
        help="a shipped config name (llama-3.1-8b), a config.json or a model directory",
    )
    parser.add_argument(
        "--memory", required=True, help="KV-cache memory budget: 80GiB, 80GB, 512MiB or bytes"
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="tokens per request (default the config's max_position_embeddings)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument(
        "--dtype",
        default=None,
        help="KV-cache dtype: bfloat16 (bf16), float16 (fp16), float32 (fp32), fp8 "
        "(default the config's torch_dtype)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens scheduled per step; bounds sliding-window and chunked memory "
        f"(default {DEFAULT_MAX_NUM_BATCHED_TOKENS})",
    )
    parser.add_argument(
        "--max-encoder-len",
        type=int,
        default=None,
        help="encoder input tokens of an encoder-decoder model (default from the config)",
    )
    parser.add_argument(
        "--disable-hybrid",
        action="store_true",
        help="manage sliding-window and chunked layers as full attention",
    )
    parser.add_argument(
        "--mamba-cache-mode",
        choices=("none", "align"),
        default="none",
        help="Mamba state blocks a request holds, as vLLM counts them: 'none' one (vLLM's "
        "default without prefix caching), 'align' two (with prefix caching)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _compact_names(layer_names: tuple[str, ...]) -> str:
    """`layers.[0-31].self_attn` for a run of numbered layers; names kept in their order."""
    template_to_indices: dict[str, list[int]] = {}
    for name in layer_names:
        match = re.search(r"\d+", name)
        if match is None:
            template_to_indices.setdefault(name, [])
            continue
        template = name[: match.start()] + "{}" + name[match.end() :]
        template_to_indices.setdefault(template, []).append(int(match.group()))
    parts = []
    for template, indices in template_to_indices.items():
        parts.append(template.format(f"[{_compact_indices(indices)}]") if indices else template)
    return ", ".join(parts)


def _compact_indices(indices: list[int]) -> str:
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ",".join(
        f"{run[0]}-{run[-1]}" if len(run) > 2 else ",".join(map(str, run)) for run in runs
    )


def _group_rows(result: Any) -> list[dict[str, Any]]:
    layout = result.layout
    rows = []
    for group_id, group in enumerate(layout.groups):
        spec = group.kv_cache_spec
        layer_pages = sorted({layout.layer_to_spec[n].page_size_bytes for n in group.layer_names})
        real_pages = sorted(
            {getattr(layout.layer_to_spec[n], "real_page_size_bytes", 0) for n in group.layer_names}
        )
        rows.append(
            {
                "group_id": group_id,
                "kind": spec.kind,
                "num_layers": len(group.layer_names),
                "layer_names": list(group.layer_names),
                "block_size": spec.block_size,
                "page_size_bytes": layer_pages[0] if len(layer_pages) == 1 else layer_pages,
                "padded_from_bytes": real_pages[0] if real_pages != layer_pages else None,
                "group_page_size_bytes": layout.group_page_size_bytes(group_id),
                "sliding_window": getattr(spec, "sliding_window", None),
                "attention_chunk_size": getattr(spec, "attention_chunk_size", None),
                "blocks_per_request": result.blocks_per_request[group_id],
            }
        )
    return rows


def _report(description: Any, result: Any, args: argparse.Namespace, fit: dict) -> dict:
    return {
        "model": description.name,
        "source": description.source,
        "model_type": description.model_type,
        "dtype": description.dtype,
        "dtype_bytes": description.dtype_bytes,
        "memory_bytes": result.available_memory_bytes,
        "max_model_len": result.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_encoder_input_tokens": result.max_num_encoder_input_tokens,
        "disable_hybrid": args.disable_hybrid,
        "groups": _group_rows(result),
        "bytes_per_block": result.bytes_per_block,
        "num_blocks": result.num_blocks,
        "blocks_per_request": sum(result.blocks_per_request),
        "bytes_per_request": result.max_memory_usage_bytes,
        "token_capacity": result.token_capacity,
        "max_concurrency": round(result.max_concurrency, 4),
        **fit,
    }


def _human_bytes(num_bytes: int) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes} B"


def _print_text(report: dict) -> None:
    print(
        f"model        {report['model']} ({report['model_type']}), dtype {report['dtype']} "
        f"({report['dtype_bytes']} bytes)"
    )
    encoder = report["max_num_encoder_input_tokens"]
    print(
        f"budget       {report['memory_bytes']} bytes ({_human_bytes(report['memory_bytes'])}), "
        f"max_model_len {report['max_model_len']}, max_num_batched_tokens "
        f"{report['max_num_batched_tokens']}" + (f", encoder tokens {encoder}" if encoder else "")
    )
    print()
    print(
        f"{'group':>5}  {'kind':<23} {'layers':>6} {'block':>6} {'page/layer':>11} "
        f"{'blocks/req':>10}  layer names"
    )
    for row in report["groups"]:
        page = row["page_size_bytes"]
        page_text = "/".join(map(str, page)) if isinstance(page, list) else str(page)
        note = f" (padded from {row['padded_from_bytes']})" if row["padded_from_bytes"] else ""
        print(
            f"{row['group_id']:>5}  {row['kind']:<23} {row['num_layers']:>6} "
            f"{row['block_size']:>6} {page_text:>11} {row['blocks_per_request']:>10}  "
            f"{_compact_names(tuple(row['layer_names']))}{note}"
        )
    print()
    rows = [
        (
            "bytes per block",
            f"{report['bytes_per_block']} ({_human_bytes(report['bytes_per_block'])})",
        ),
        ("num_blocks", f"{report['num_blocks']} (block 0 is the null block)"),
        (
            "blocks per request",
            f"{report['blocks_per_request']} ({_human_bytes(report['bytes_per_request'])} "
            f"at max_model_len {report['max_model_len']})",
        ),
        ("token capacity", f"{report['token_capacity']} tokens"),
        (
            "max concurrency",
            f"{report['max_concurrency']:.2f}x for {report['max_model_len']}-token requests",
        ),
        (
            "longest request",
            f"{report['max_model_len_that_fits']} tokens fit in one request "
            f"(searched up to {report['max_model_len_search_limit']})",
        ),
    ]
    for label, value in rows:
        print(f"{label:<19}{value}")


def run(args: argparse.Namespace) -> int:
    from pagedkv.errors import PagedKVError

    try:
        report = _size(args)
    except PagedKVError as exc:
        print(f"pagedkv size: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_text(report)
    return 0


def _size(args: argparse.Namespace) -> dict:
    from pagedkv.errors import InvalidArgumentError
    from pagedkv.sizing import estimate_max_model_len, size_kv_cache
    from pagedkv.sizing.model_config import load_model_description

    memory_bytes = parse_memory_bytes(args.memory)
    for flag, value in (
        ("--block-size", args.block_size),
        ("--max-model-len", args.max_model_len),
        ("--max-num-batched-tokens", args.max_num_batched_tokens),
        ("--max-encoder-len", args.max_encoder_len),
    ):
        if value is not None and value <= 0:
            raise InvalidArgumentError(f"{flag} must be positive, got {value}")
    description = load_model_description(
        args.config,
        block_size=args.block_size,
        dtype=args.dtype,
        mamba_cache_mode=args.mamba_cache_mode,
    )
    max_model_len = args.max_model_len or description.max_position_embeddings
    if max_model_len is None:
        raise InvalidArgumentError(
            f"{description.source} names no max_position_embeddings: pass --max-model-len"
        )
    encoder_len = (
        description.max_num_encoder_input_tokens
        if args.max_encoder_len is None
        else args.max_encoder_len
    )
    sizing_args = {
        "max_in_flight_tokens": args.max_num_batched_tokens,
        "max_num_encoder_input_tokens": encoder_len,
    }
    result = size_kv_cache(
        description.layer_to_spec,
        memory_bytes,
        max_model_len,
        disable_hybrid=args.disable_hybrid,
        **sizing_args,
    )
    search_limit = max(max_model_len, description.max_position_embeddings or 0)
    fit = {
        "max_model_len_that_fits": estimate_max_model_len(
            result.layout, memory_bytes, search_limit, **sizing_args
        ),
        "max_model_len_search_limit": search_limit,
    }
    return _report(description, result, args, fit)
