#!/usr/bin/env python3
"""Prefix-cache hashing throughput: vLLM's, pagedkv's (same algorithm name) and the floor.

Three numbers per block size, each in tokens per second over the same token stream:
- vLLM: the request block hasher vLLM's engine installs by default
  (`get_request_block_hasher(block_size, sha256)`, SHA-256 over a pickled
  `(parent, tokens, extra_keys)` tuple), run in the peer venv;
- pagedkv: `make_request_block_hasher(block_size, "sha256")` over a `pagedkv.Request`;
- floor: hashlib SHA-256 over the packed (uint32) token bytes of every block, with no Python
  per-block work beyond the digest call, measured in the same process as each implementation,
  interleaved with it.
Three modes: `prompt` hashes a whole prompt in one hasher call on an unhashed request (pagedkv
packs the tokens inside it); `admit` is the call the request constructor makes (pagedkv packs
the prompt once to validate it and hands the hasher those bytes, so packing is outside the
timer; for vLLM it is the `prompt` call); `append` grows a request one token per
`append_output_token_ids(int)` call, as decode does, so every block is hashed by its own
hasher call (tokens/s then includes the per-token append itself).

`--algorithm sha256_cbor` compares the algorithm whose hashes equal vLLM's (SHA-256 of the
canonical CBOR of the tuple) instead of the defaults (vLLM: pickle; pagedkv: packed bytes), and
`--prompt-lens 512,2048,8192,32768` adds, at block size 16, per prompt length: `admit` (the
hasher call of the constructor, as above) and `build` (the whole constructor with its hasher),
each over enough distinct prompts of that length to hash --num-tokens tokens.

The runner (this file without --child) starts one child per implementation, alternating, and
prints medians and ratios; JSON goes to benchmarks/results/.

  python benchmarks/peer/bench_hashing.py --algorithm sha256_cbor --prompt-lens 512,2048,8192,32768
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
import time
from array import array
from pathlib import Path

HERE = Path(__file__).resolve().parent
clock = time.perf_counter  # --clock cpu: time.thread_time (steadier on a busy machine)
REPO = HERE.parent.parent
DEFAULT_VLLM_PYTHON = os.environ.get("PEER_PYTHON", str(REPO / ".peer-venv" / "bin" / "python"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-tokens", type=int, default=131072, help="tokens hashed per measurement")
    p.add_argument("--block-sizes", default="16,64,256")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats inside each child")
    p.add_argument("--rounds", type=int, default=2, help="child processes per implementation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall: perf_counter; cpu: the thread's CPU time",
    )
    p.add_argument(
        "--algorithm",
        default="sha256",
        choices=["sha256", "sha256_cbor"],
        help="the same algorithm name in both libraries",
    )
    p.add_argument("--vocab", type=int, default=32000, help="token ids drawn below this")
    p.add_argument(
        "--prompt-lens",
        default="",
        help="comma-separated prompt lengths for the per-length rows (block 16)",
    )
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--pagedkv-python", default=sys.executable)
    p.add_argument("--child", choices=["vllm", "pagedkv"], help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- child side


VOCAB = 32000  # --vocab; the kit's drivers draw token ids below 32,000


def make_tokens(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(num_tokens)]


def floor_seconds(packed: bytes, block_size: int) -> float:
    """hashlib over every block of the packed bytes; nothing else per block."""
    sha256 = hashlib.sha256
    step = 4 * block_size
    t0 = clock()
    [sha256(packed[i : i + step]).digest() for i in range(0, len(packed), step)]
    return clock() - t0


def vllm_impl(block_size: int, algorithm: str) -> dict:
    """Timers (mode -> tokens -> (seconds, hashes made)) for vLLM's request hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algorithm)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)

    def build(tokens: list[int], block_hasher) -> Request:
        return Request(
            request_id="r",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=1 << 20),
            pooling_params=None,
            block_hasher=block_hasher,
        )

    timers = _timers(build, hasher, block_size)
    timers["admit"] = timers["prompt"]  # vLLM's constructor makes exactly this call
    return timers


def pagedkv_impl(block_size: int, algorithm: str) -> dict:
    """Timers (mode -> tokens -> (seconds, hashes made)) for pagedkv's request hasher."""
    from pagedkv import Request, make_request_block_hasher
    from pagedkv.hashing import pack_token_ids

    hasher = make_request_block_hasher(block_size, algorithm)

    def build(tokens: list[int], block_hasher) -> Request:
        return Request("r", tokens, block_hasher=block_hasher)

    timers = _timers(build, hasher, block_size)
    if "packed_tokens" in inspect.signature(hasher.__call__).parameters:

        def admit(tokens: list[int]) -> tuple[float, int]:
            req = build(tokens, None)
            packed = pack_token_ids(tokens)  # done by the constructor anyway, to validate
            t0 = clock()
            hashes = hasher(req, packed_tokens=packed)
            return clock() - t0, len(hashes)

        timers["admit"] = admit
    else:
        timers["admit"] = timers["prompt"]
    return timers


def _timers(build, hasher, block_size: int) -> dict:
    """prompt: one hasher call over an unhashed request holding the whole prompt;
    append: one `append_output_token_ids(int)` per token after the first block."""

    def prompt(tokens: list[int]) -> tuple[float, int]:
        req = build(tokens, None)
        t0 = clock()
        hashes = hasher(req)
        return clock() - t0, len(hashes)

    def append(tokens: list[int]) -> tuple[float, int]:
        req = build(tokens[:block_size], hasher)
        append_token = req.append_output_token_ids
        t0 = clock()
        for token in tokens[block_size:]:
            append_token(token)
        return clock() - t0, len(req.block_hashes)

    def build_hashed(tokens: list[int]) -> tuple[float, int]:
        t0 = clock()
        req = build(tokens, hasher)
        return clock() - t0, len(req.block_hashes)

    return {"prompt": prompt, "append": append, "build": build_hashed}


def child(args: argparse.Namespace) -> int:
    tokens = make_tokens(args.num_tokens, args.seed)
    packed = array("I", tokens).tobytes()
    make = vllm_impl if args.child == "vllm" else pagedkv_impl
    out: dict = {
        "impl": args.child,
        "python": sys.version.split()[0],
        "block_sizes": {},
        "prompt_lens": {},
    }
    for block_size in (int(b) for b in args.block_sizes.split(",") if b):
        timers = make(block_size, args.algorithm)
        del timers["build"]
        times: dict[str, list[float]] = {mode: [] for mode in [*timers, "floor"]}
        num_blocks = args.num_tokens // block_size
        for _ in range(args.repeats):  # interleaved, so load changes hit every mode alike
            for mode, timer in timers.items():
                seconds, count = timer(tokens)
                assert count == num_blocks, (mode, count, num_blocks)
                times[mode].append(seconds)
            times["floor"].append(floor_seconds(packed, block_size))
        # Best of the repeats inside a process (the least disturbed by other load); the
        # runner takes the median over processes.
        med = {mode: min(values) for mode, values in times.items()}
        n = args.num_tokens
        out["block_sizes"][block_size] = {
            "prompt_tokens_per_s": n / med["prompt"],
            "admit_tokens_per_s": n / med["admit"],
            "append_tokens_per_s": (n - block_size) / med["append"],
            "floor_tokens_per_s": n / med["floor"],
            "best_seconds": med,
        }
    for prompt_len in (int(n) for n in args.prompt_lens.split(",") if n):
        out["prompt_lens"][prompt_len] = prompt_len_rates(
            make(16, args.algorithm), prompt_len, args
        )
    print(json.dumps(out))
    return 0


def prompt_len_rates(timers: dict, prompt_len: int, args: argparse.Namespace) -> dict:
    """Tokens/s of `admit` and `build` over distinct prompts of one length (block size 16)."""
    prompts = [
        make_tokens(prompt_len, args.seed + 1 + index)
        for index in range(max(1, args.num_tokens // prompt_len))
    ]
    for prompt in prompts[:4]:  # warm-up: first calls (and pagedkv's CBOR memo) untimed
        timers["build"](prompt)
    best = {}
    for mode in ("admit", "build"):
        totals = []
        for _ in range(args.repeats):
            seconds = 0.0
            for prompt in prompts:
                elapsed, count = timers[mode](prompt)
                assert count == prompt_len // 16, (mode, count)
                seconds += elapsed
            totals.append(seconds)
        best[mode] = min(totals)
    num_tokens = len(prompts) * prompt_len
    return {f"{mode}_tokens_per_s": num_tokens / seconds for mode, seconds in best.items()}


# ----------------------------------------------------------------------------- runner side


def run_child(python: str, impl: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if impl == "pagedkv":
        src = str(REPO / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--child",
        impl,
        "--num-tokens",
        str(args.num_tokens),
        "--block-sizes",
        args.block_sizes,
        "--repeats",
        str(args.repeats),
        "--seed",
        str(args.seed),
        "--algorithm",
        args.algorithm,
        "--prompt-lens",
        args.prompt_lens,
        "--clock",
        args.clock,
        "--vocab",
        str(args.vocab),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def runner(args: argparse.Namespace) -> int:
    if not Path(args.vllm_python).exists():
        raise SystemExit(
            f"no peer venv python at {args.vllm_python}: build it with "
            "bash benchmarks/peer/vllm/setup_venv.sh DIR, then pass "
            "--vllm-python DIR/bin/python"
        )
    results: dict[str, list[dict]] = {"vllm": [], "pagedkv": []}
    pythons = {"vllm": args.vllm_python, "pagedkv": args.pagedkv_python}
    load_start = os.getloadavg()
    for rnd in range(args.rounds):
        for impl in ("vllm", "pagedkv") if rnd % 2 == 0 else ("pagedkv", "vllm"):
            print(f"[round {rnd + 1}/{args.rounds}] {impl}", file=sys.stderr, flush=True)
            results[impl].append(run_child(pythons[impl], impl, args))
    table = {}
    print(
        f"\n{args.algorithm} prefix-cache hashing, {args.num_tokens} tokens (ids below "
        f"{args.vocab}), tokens/s (millions, {args.clock} clock), median over {args.rounds} "
        f"processes of the best of {args.repeats} repeats"
    )
    print(
        f"{'block':>6} {'mode':>7} {'vLLM':>9} {'pagedkv':>9} {'floor':>9} "
        f"{'pagedkv/vLLM':>13} {'floor/pagedkv':>14} {'floor/vLLM':>11}"
    )
    for block_size in (b for b in args.block_sizes.split(",") if b):

        def med(impl: str, key: str, bs: str = block_size) -> float:
            return statistics.median(r["block_sizes"][bs][key] for r in results[impl])

        # The floor from both processes (same interpreter build): one number for the table.
        floor = statistics.median(
            [
                r["block_sizes"][block_size]["floor_tokens_per_s"]
                for rs in results.values()
                for r in rs
            ]
        )
        for mode in ("prompt", "admit", "append"):
            v, p = med("vllm", f"{mode}_tokens_per_s"), med("pagedkv", f"{mode}_tokens_per_s")
            row = {
                "vllm_tokens_per_s": v,
                "pagedkv_tokens_per_s": p,
                "floor_tokens_per_s": floor,
                "pagedkv_over_vllm": p / v,
                "floor_over_pagedkv": floor / p,
                "floor_over_vllm": floor / v,
            }
            table[f"{block_size}/{mode}"] = row
            print(
                f"{block_size:>6} {mode:>7} {v / 1e6:>9.2f} {p / 1e6:>9.2f} {floor / 1e6:>9.2f} "
                f"{p / v:>13.2f} {floor / p:>14.2f} {floor / v:>11.2f}"
            )
    if args.prompt_lens:
        print(
            f"\nper prompt length (block size 16; distinct prompts, {args.num_tokens} tokens "
            "per measurement), tokens/s (millions)"
        )
        print(f"{'tokens':>7} {'mode':>7} {'vLLM':>9} {'pagedkv':>9} {'pagedkv/vLLM':>13}")
    for prompt_len in (n for n in args.prompt_lens.split(",") if n):
        for mode in ("admit", "build"):
            key = f"{mode}_tokens_per_s"
            v = statistics.median(r["prompt_lens"][prompt_len][key] for r in results["vllm"])
            p = statistics.median(r["prompt_lens"][prompt_len][key] for r in results["pagedkv"])
            table[f"len{prompt_len}/{mode}"] = {
                "vllm_tokens_per_s": v,
                "pagedkv_tokens_per_s": p,
                "pagedkv_over_vllm": p / v,
            }
            print(f"{prompt_len:>7} {mode:>7} {v / 1e6:>9.3f} {p / 1e6:>9.3f} {p / v:>13.2f}")
    record = {
        "command": " ".join([sys.executable, *sys.argv]),
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "table": table,
        "runs": results,
    }
    started = time.strftime("%Y%m%d-%H%M%S")
    default_out = REPO / "benchmarks" / "results" / f"peer_hashing_{started}.json"
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"loadavg {load_start} -> {record['loadavg_end']}; JSON: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    global clock, VOCAB
    args = parse_args(argv)
    VOCAB = args.vocab
    if args.clock == "cpu":
        clock = time.thread_time
    return child(args) if args.child else runner(args)


if __name__ == "__main__":
    sys.exit(main())
