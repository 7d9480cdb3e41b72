#!/usr/bin/env python3
"""Replay one of scenarios.py's workloads against pagedkv or vLLM 0.33; print one JSON line.

  python scenario_driver.py --impl pagedkv --workload gemma3 [--batched-decode] [--check]
  /path/peer-venv/bin/python scenario_driver.py --impl vllm --workload gemma3

The scheduler loop is scenarios.py's, shared by both; this file holds only the two adapters
(how to build the manager and a request in each library) and the command line. The JSON has
the keys of the kit's drivers (per-method timings, hash_seconds, workload statistics) plus
`block_ids_digest` / `request_block_digests` (every block id each request was handed, folded
into one digest per request) and `free_queue_digest` (the final eviction order), so
run_compare.py can check that both managers made the same decisions.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import SCENARIOS, Kit, Run, Scenario  # noqa: E402  (a sibling script)

NUM_KV_HEADS = 8
HEAD_SIZE = 128


class PagedKit(Kit):
    """pagedkv: specs carry dtype_bytes; requests hash themselves with the given algorithm."""

    name = "pagedkv"

    def __init__(self, algorithm: str, block_size: int) -> None:
        import pagedkv

        self.pagedkv = pagedkv
        self.hasher = pagedkv.make_request_block_hasher(block_size, algorithm)
        self.RUNNING = pagedkv.RequestStatus.RUNNING
        self.PREEMPTED = pagedkv.RequestStatus.PREEMPTED
        self.FINISHED = pagedkv.RequestStatus.FINISHED_LENGTH_CAPPED
        self.version = pagedkv.__version__

    def build_manager(self, scenario: Scenario) -> Any:
        p = self.pagedkv
        groups = []
        for index, window in enumerate(scenario.groups):
            if window is None:
                spec = p.FullAttentionSpec(scenario.block_size, NUM_KV_HEADS, HEAD_SIZE, 2)
            else:
                spec = p.SlidingWindowSpec(
                    scenario.block_size, NUM_KV_HEADS, HEAD_SIZE, 2, sliding_window=window
                )
            groups.append(p.KVCacheGroupSpec((f"model.layers.{index}.self_attn",), spec))
        config = p.KVCacheConfig(num_blocks=scenario.num_blocks, kv_cache_groups=tuple(groups))
        return p.KVCacheManager(
            config,
            max_model_len=scenario.max_model_len,
            scheduler_block_size=scenario.block_size,
            hash_block_size=scenario.block_size,
        )

    def make_request(self, rid: str, prompt: list[int], max_tokens: int) -> Any:
        return self.pagedkv.Request(rid, prompt, max_tokens=max_tokens, block_hasher=self.hasher)

    def check(self, manager: Any) -> None:
        manager.check_invariants()


class VllmKit(Kit):
    """vLLM 0.33: torch dtypes, SamplingParams, the engine's request block hasher."""

    name = "vllm"

    def __init__(self, algorithm: str, block_size: int) -> None:
        import torch
        import vllm
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request, RequestStatus

        hash_fn = get_hash_fn_by_name(algorithm)
        init_none_hash(hash_fn)  # as EngineCore.__init__ does
        self.hasher = get_request_block_hasher(block_size, hash_fn)
        self.torch = torch
        self.SamplingParams = SamplingParams
        self.Request = Request
        self.RUNNING = RequestStatus.RUNNING
        self.PREEMPTED = RequestStatus.PREEMPTED
        self.FINISHED = RequestStatus.FINISHED_LENGTH_CAPPED
        self.version = vllm.__version__

    def build_manager(self, scenario: Scenario) -> Any:
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        dtype = self.torch.float16
        groups = []
        for index, window in enumerate(scenario.groups):
            if window is None:
                spec = FullAttentionSpec(
                    block_size=scenario.block_size,
                    num_kv_heads=NUM_KV_HEADS,
                    head_size=HEAD_SIZE,
                    dtype=dtype,
                )
            else:
                spec = SlidingWindowSpec(
                    block_size=scenario.block_size,
                    num_kv_heads=NUM_KV_HEADS,
                    head_size=HEAD_SIZE,
                    dtype=dtype,
                    sliding_window=window,
                )
            groups.append(KVCacheGroupSpec([f"model.layers.{index}.self_attn"], spec))
        config = KVCacheConfig(
            num_blocks=scenario.num_blocks, kv_cache_tensors=[], kv_cache_groups=groups
        )
        return KVCacheManager(
            config,
            max_model_len=scenario.max_model_len,
            scheduler_block_size=scenario.block_size,
            hash_block_size=scenario.block_size,
        )

    def make_request(self, rid: str, prompt: list[int], max_tokens: int) -> Any:
        return self.Request(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling_params=self.SamplingParams(max_tokens=max_tokens),
            pooling_params=None,
            block_hasher=self.hasher,
        )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--impl", choices=["pagedkv", "vllm"], required=True)
    p.add_argument("--workload", choices=list(SCENARIOS), required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="fraction of the workload's requests (conversations) to run",
    )
    p.add_argument(
        "--hash",
        default="sha256",
        choices=["sha256", "sha256_cbor"],
        help="prefix-cache hash algorithm, the same name in both libraries",
    )
    p.add_argument(
        "--batched-decode",
        action="store_true",
        help="pagedkv: decode through allocate_decode_slots (one call per step)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="pagedkv: check_invariants() after every step (slow, untimed)",
    )
    p.add_argument("--no-gc", action="store_true", help="gc.disable() during the replay")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scenario = SCENARIOS[args.workload]
    kit: Kit = (PagedKit if args.impl == "pagedkv" else VllmKit)(args.hash, scenario.block_size)
    if args.batched_decode and args.impl != "pagedkv":
        raise SystemExit("--batched-decode: only pagedkv has allocate_decode_slots")
    run = Run(scenario, kit, args.seed, args.scale, args.batched_decode, args.check)
    if args.no_gc:
        gc.disable()
    wall = run.run()
    out = run.report(wall)
    out["args"] = vars(args)
    out["version"] = kit.version
    out["python"] = sys.version.split()[0]
    print(json.dumps(out))
    return 0 if out["free_check_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
