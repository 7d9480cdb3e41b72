#!/usr/bin/env python3
"""Prefix-cache hashing throughput: vLLM's default, pagedkv's sha256 and the physical floor.

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

The runner (this file without --child) starts one child per implementation, alternating, and
prints medians and ratios; JSON goes to benchmarks/results/.
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
from time import perf_counter

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
DEFAULT_VLLM_PYTHON = os.environ.get("PEER_PYTHON", "/work/.peer-venv/bin/python")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-tokens", type=int, default=131072, help="tokens hashed per measurement")
    p.add_argument("--block-sizes", default="16,64,256")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats inside each child")
    p.add_argument("--rounds", type=int, default=2, help="child processes per implementation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON)
    p.add_argument("--pagedkv-python", default=sys.executable)
    p.add_argument("--child", choices=["vllm", "pagedkv"], help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- child side


def make_tokens(num_tokens: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(32000) for _ in range(num_tokens)]


def floor_seconds(packed: bytes, block_size: int) -> float:
    """hashlib over every block of the packed bytes; nothing else per block."""
    sha256 = hashlib.sha256
    step = 4 * block_size
    t0 = perf_counter()
    [sha256(packed[i : i + step]).digest() for i in range(0, len(packed), step)]
    return perf_counter() - t0


def vllm_impl(block_size: int) -> dict:
    """Timers (mode -> tokens -> (seconds, hashes made)) for vLLM's default request hasher."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(block_size, hash_fn)

    def build(tokens: list[int], block_hasher) -> Request:
        return Request(request_id="r", prompt_token_ids=tokens,
                       sampling_params=SamplingParams(max_tokens=1 << 20), pooling_params=None,
                       block_hasher=block_hasher)

    timers = _timers(build, hasher, block_size)
    timers["admit"] = timers["prompt"]  # vLLM's constructor makes exactly this call
    return timers


def pagedkv_impl(block_size: int) -> dict:
    """Timers (mode -> tokens -> (seconds, hashes made)) for pagedkv's sha256 request hasher."""
    from pagedkv import Request, make_request_block_hasher
    from pagedkv.hashing import pack_token_ids

    hasher = make_request_block_hasher(block_size, "sha256")

    def build(tokens: list[int], block_hasher) -> Request:
        return Request("r", tokens, block_hasher=block_hasher)

    timers = _timers(build, hasher, block_size)
    if "packed_tokens" in inspect.signature(hasher.__call__).parameters:

        def admit(tokens: list[int]) -> tuple[float, int]:
            req = build(tokens, None)
            packed = pack_token_ids(tokens)  # done by the constructor anyway, to validate
            t0 = perf_counter()
            hashes = hasher(req, packed_tokens=packed)
            return perf_counter() - t0, len(hashes)

        timers["admit"] = admit
    else:
        timers["admit"] = timers["prompt"]
    return timers


def _timers(build, hasher, block_size: int) -> dict:
    """prompt: one hasher call over an unhashed request holding the whole prompt;
    append: one `append_output_token_ids(int)` per token after the first block."""

    def prompt(tokens: list[int]) -> tuple[float, int]:
        req = build(tokens, None)
        t0 = perf_counter()
        hashes = hasher(req)
        return perf_counter() - t0, len(hashes)

    def append(tokens: list[int]) -> tuple[float, int]:
        req = build(tokens[:block_size], hasher)
        append_token = req.append_output_token_ids
        t0 = perf_counter()
        for token in tokens[block_size:]:
            append_token(token)
        return perf_counter() - t0, len(req.block_hashes)

    return {"prompt": prompt, "append": append}


def child(args: argparse.Namespace) -> int:
    tokens = make_tokens(args.num_tokens, args.seed)
    packed = array("I", tokens).tobytes()
    make = vllm_impl if args.child == "vllm" else pagedkv_impl
    out: dict = {"impl": args.child, "python": sys.version.split()[0], "block_sizes": {}}
    for block_size in (int(b) for b in args.block_sizes.split(",")):
        timers = make(block_size)
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
    print(json.dumps(out))
    return 0


# ----------------------------------------------------------------------------- runner side


def run_child(python: str, impl: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ)
    if impl == "pagedkv":
        src = str(REPO / "src")
        env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [python, str(Path(__file__).resolve()), "--child", impl,
           "--num-tokens", str(args.num_tokens), "--block-sizes", args.block_sizes,
           "--repeats", str(args.repeats), "--seed", str(args.seed)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def runner(args: argparse.Namespace) -> int:
    if not Path(args.vllm_python).exists():
        raise SystemExit(f"no peer venv python at {args.vllm_python}: build it with "
                         "bash benchmarks/peer/vllm/setup_venv.sh DIR, then pass "
                         "--vllm-python DIR/bin/python")
    results: dict[str, list[dict]] = {"vllm": [], "pagedkv": []}
    pythons = {"vllm": args.vllm_python, "pagedkv": args.pagedkv_python}
    load_start = os.getloadavg()
    for rnd in range(args.rounds):
        for impl in (("vllm", "pagedkv") if rnd % 2 == 0 else ("pagedkv", "vllm")):
            print(f"[round {rnd + 1}/{args.rounds}] {impl}", file=sys.stderr, flush=True)
            results[impl].append(run_child(pythons[impl], impl, args))
    table = {}
    print(f"\nsha256 prefix-cache hashing, {args.num_tokens} tokens, tokens/s (millions), "
          f"median over {args.rounds} processes of the best of {args.repeats} repeats")
    print(f"{'block':>6} {'mode':>7} {'vLLM':>9} {'pagedkv':>9} {'floor':>9} "
          f"{'pagedkv/vLLM':>13} {'floor/pagedkv':>14} {'floor/vLLM':>11}")
    for block_size in args.block_sizes.split(","):
        def med(impl: str, key: str, bs: str = block_size) -> float:
            return statistics.median(r["block_sizes"][bs][key] for r in results[impl])

        # The floor from both processes (same interpreter build): one number for the table.
        floor = statistics.median(
            [r["block_sizes"][block_size]["floor_tokens_per_s"] for rs in results.values()
             for r in rs])
        for mode in ("prompt", "admit", "append"):
            v, p = med("vllm", f"{mode}_tokens_per_s"), med("pagedkv", f"{mode}_tokens_per_s")
            row = {"vllm_tokens_per_s": v, "pagedkv_tokens_per_s": p, "floor_tokens_per_s": floor,
                   "pagedkv_over_vllm": p / v, "floor_over_pagedkv": floor / p,
                   "floor_over_vllm": floor / v}
            table[f"{block_size}/{mode}"] = row
            print(f"{block_size:>6} {mode:>7} {v / 1e6:>9.2f} {p / 1e6:>9.2f} {floor / 1e6:>9.2f} "
                  f"{p / v:>13.2f} {floor / p:>14.2f} {floor / v:>11.2f}")
    record = {"command": " ".join([sys.executable, *sys.argv]), "loadavg_start": load_start,
              "loadavg_end": os.getloadavg(), "cpu_count": os.cpu_count(), "table": table,
              "runs": results}
    started = time.strftime("%Y%m%d-%H%M%S")
    default_out = REPO / "benchmarks" / "results" / f"peer_hashing_{started}.json"
    out = Path(args.out) if args.out else default_out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"loadavg {load_start} -> {record['loadavg_end']}; JSON: {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return child(args) if args.child else runner(args)


if __name__ == "__main__":
    sys.exit(main())
