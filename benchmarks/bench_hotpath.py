"""The hot paths of issue 12 item 5, timed in-process; optionally against another source tree.

Three measurements, each on the thread's CPU clock (a busy machine inflates wall time):
- hybrid decode: a Gemma-3-like layout (1 full-attention + 5 sliding-window groups, 1,024-token
  window, block size 16), 64 running requests with 2,000-token prompts over 8 system prompts;
  512 decode steps as `allocate_slots(request, 1)` per request (us per call) and, on a second
  identical manager, as one `allocate_decode_slots(running)` per step (us per request);
- free: `free(request)` of those 64 hybrid requests, and of 64 single-group chat-like requests
  (3,000 tokens, the first 1,000 shared), us per call;
- sha256_cbor: building a request (the constructor hashes its prompt) at 512, 2,048, 8,192 and
  32,768 tokens, us per 16-token block (after one untimed build of the same prompt).

    python benchmarks/bench_hotpath.py                       # this tree
    python benchmarks/bench_hotpath.py --baseline-src DIR    # also DIR (e.g. main's src/),
                                                             # alternating child processes

With `--baseline-src`, each round runs one child per tree (alternating which goes first) and
the table shows medians over rounds and the ratio this/baseline. Prints JSON with --json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path
from time import thread_time

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
PROMPT_LENGTHS = (512, 2048, 8192, 32768)


def hybrid_manager(pagedkv, num_blocks: int):
    groups = [pagedkv.KVCacheGroupSpec(("layer0",), pagedkv.FullAttentionSpec(16, 8, 128, 2))]
    for index in range(1, 6):
        spec = pagedkv.SlidingWindowSpec(16, 8, 128, 2, sliding_window=1024)
        groups.append(pagedkv.KVCacheGroupSpec((f"layer{index}",), spec))
    config = pagedkv.KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=tuple(groups))
    return pagedkv.KVCacheManager(config, max_model_len=4096)


def admit_all(pagedkv, manager, prompts: list[list[int]]) -> list:
    hasher = pagedkv.make_request_block_hasher(16)
    running = []
    for index, prompt in enumerate(prompts):
        request = pagedkv.Request(f"r{index}", prompt, block_hasher=hasher)
        hit_blocks, num_hit, _ = manager.get_computed_blocks(request)
        blocks = manager.allocate_slots(request, request.num_tokens - num_hit, num_hit, hit_blocks)
        assert blocks is not None
        request.num_computed_tokens = request.num_tokens
        request.status = pagedkv.RequestStatus.RUNNING
        request.append_output_token_ids(7)
        running.append(request)
    return running


def bench_hybrid(pagedkv, steps: int) -> dict:
    rng = random.Random(0)
    systems = [[rng.randrange(32000) for _ in range(1024)] for _ in range(8)]
    prompts = [rng.choice(systems) + [rng.randrange(32000) for _ in range(976)] for _ in range(64)]
    out: dict[str, float] = {}
    for mode in ("per_call", "batched"):
        manager = hybrid_manager(pagedkv, 40000)
        running = admit_all(pagedkv, manager, prompts)
        seconds = 0.0
        for step in range(steps):
            if mode == "per_call":
                allocate = manager.allocate_slots
                t0 = thread_time()
                for request in running:
                    allocate(request, 1)
                seconds += thread_time() - t0
            else:
                t0 = thread_time()
                result = manager.allocate_decode_slots(running)
                seconds += thread_time() - t0
                assert result.num_allocated == len(running)
            for request in running:
                request.num_computed_tokens += 1
                request.append_output_token_ids(step % 32000)
        out[f"hybrid_decode_{mode}_us"] = 1e6 * seconds / (steps * len(running))
        t0 = thread_time()
        for request in running:
            manager.free(request)
        out["hybrid_free_us" if mode == "per_call" else "hybrid_free_again_us"] = (
            1e6 * (thread_time() - t0) / len(running)
        )
    return out


def bench_free_single(pagedkv) -> float:
    rng = random.Random(1)
    spec = pagedkv.FullAttentionSpec(16, 8, 128, 2)
    config = pagedkv.KVCacheConfig(20000, (pagedkv.KVCacheGroupSpec(("layer0",), spec),))
    manager = pagedkv.KVCacheManager(config, max_model_len=4096)
    shared = [rng.randrange(32000) for _ in range(1000)]
    prompts = [shared + [rng.randrange(32000) for _ in range(2000)] for _ in range(64)]
    running = admit_all(pagedkv, manager, prompts)
    t0 = thread_time()
    for request in running:
        manager.free(request)
    return 1e6 * (thread_time() - t0) / len(running)


def bench_cbor(pagedkv) -> dict:
    rng = random.Random(2)
    hasher = pagedkv.make_request_block_hasher(16, "sha256_cbor")
    out = {}
    for num_tokens in PROMPT_LENGTHS:
        prompts = [[rng.randrange(32000) for _ in range(num_tokens)] for _ in range(4)]
        repeats = max(1, 32768 // num_tokens)
        best = float("inf")
        for prompt in prompts:
            pagedkv.Request("warm-up", prompt, block_hasher=hasher)  # sha256_cbor memoises ids
            t0 = thread_time()
            for index in range(repeats):
                pagedkv.Request(f"c{index}", prompt, block_hasher=hasher)
            best = min(best, (thread_time() - t0) / repeats)
        out[f"cbor_build_{num_tokens}_us_per_block"] = 1e6 * best / (num_tokens // 16)
    return out


def child(steps: int) -> dict:
    import pagedkv

    result = {"src": str(Path(pagedkv.__file__).resolve().parent.parent)}
    result.update(bench_hybrid(pagedkv, steps))
    result["single_free_us"] = bench_free_single(pagedkv)
    result.update(bench_cbor(pagedkv))
    return result


def run_child(src: Path, steps: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(src))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--steps", str(steps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        raise SystemExit(f"child for {src} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline-src", type=Path, help="another tree's src/ to compare with")
    p.add_argument("--rounds", type=int, default=3, help="child processes per tree")
    p.add_argument("--steps", type=int, default=512, help="hybrid decode steps")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.steps)))
        return 0
    trees = {"this": SRC}
    if args.baseline_src:
        trees["baseline"] = args.baseline_src.resolve()
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for round_index in range(args.rounds):
        order = list(trees) if round_index % 2 == 0 else list(reversed(trees))
        for name in order:
            runs[name].append(run_child(trees[name], args.steps))
    keys = [k for k in runs["this"][0] if k != "src"]
    table = {
        name: {k: statistics.median(r[k] for r in name_runs) for k in keys}
        for name, name_runs in runs.items()
    }
    if args.json:
        print(json.dumps({"trees": {k: str(v) for k, v in trees.items()}, "median": table}))
        return 0
    print(f"median of {args.rounds} child processes per tree, thread CPU time")
    header = f"{'':34}{'this':>12}"
    if "baseline" in table:
        header += f"{'baseline':>12}{'this/base':>11}"
    print(header)
    for key in keys:
        line = f"{key:34}{table['this'][key]:>12.3f}"
        if "baseline" in table:
            base = table["baseline"][key]
            line += f"{base:>12.3f}{table['this'][key] / base:>11.2f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
