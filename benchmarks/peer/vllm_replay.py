#!/usr/bin/env python3
"""Trace replay through vLLM 0.33's own KVCacheManager, the peer of `simulate --mode replay`.

Run it with the peer venv's python (benchmarks/peer/vllm/setup_venv.sh). Per request of the
trace, in order: the prompt's token ids exactly as pagedkv's loader builds them from the hash
ids (`pagedkv.sim.inputs.traces`, imported from this checkout's src/), a vLLM `Request` hashed by
vLLM's own block hasher (SHA-256, as vLLM's default), `get_computed_blocks`, `allocate_slots`
for the rest of the prompt, `free`. One capacity, one pass. Prints one JSON line: hit tokens,
requests that did not fit, and CPU seconds of the import, of the replay and of the process.

  /path/to/peer-venv/bin/python benchmarks/peer/vllm_replay.py --trace T --block-size 16 \\
      --capacity 1000000
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--capacity", type=int, default=1_000_000, help="usable blocks")
    parser.add_argument("--num-requests", type=int, default=None, help="first N requests only")
    return parser.parse_args(argv)


def process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import_start = time.process_time()
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    sys.path.insert(0, str(REPO / "src"))
    from pagedkv.sim.inputs.traces import load_trace

    import_cpu_s = time.process_time() - import_start

    replay_start = time.process_time()
    trace = load_trace(args.trace, limit=args.num_requests)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(args.block_size, hash_fn)
    spec = FullAttentionSpec(
        block_size=args.block_size, num_kv_heads=1, head_size=1, dtype=torch.float16
    )
    config = KVCacheConfig(
        num_blocks=args.capacity + 1,  # block 0 is the null block, as in pagedkv
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    max_model_len = max(request.num_prompt_tokens for request in trace.requests)
    manager = KVCacheManager(
        config,
        max_model_len=max_model_len,
        scheduler_block_size=args.block_size,
        hash_block_size=args.block_size,
        enable_caching=True,
    )
    num_hit_tokens = num_not_fit = 0
    sampling_params = SamplingParams(max_tokens=1)
    for trace_request in trace.requests:
        request = Request(
            request_id=trace_request.request_id,
            prompt_token_ids=trace_request.prompt_token_ids(),
            sampling_params=sampling_params,
            pooling_params=None,
            block_hasher=hasher,
        )
        hit_blocks, num_hit = manager.get_computed_blocks(request)[:2]
        allocated = manager.allocate_slots(
            request, request.num_tokens - num_hit, num_hit, hit_blocks
        )
        if allocated is None:
            num_not_fit += 1
            continue
        num_hit_tokens += num_hit
        manager.free(request)
    replay_cpu_s = time.process_time() - replay_start
    print(
        json.dumps(
            {
                "num_requests": len(trace.requests),
                "num_prompt_tokens": trace.num_prompt_tokens,
                "num_hit_tokens": num_hit_tokens,
                "num_requests_not_fit": num_not_fit,
                "import_cpu_s": round(import_cpu_s, 3),
                "replay_cpu_s": round(replay_cpu_s, 3),
                "process_cpu_s": round(process_cpu_s(), 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
