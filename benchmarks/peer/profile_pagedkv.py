#!/usr/bin/env python3
"""Profile pagedkv's manager on the peer workloads, one cProfile per kind of call.

Replays a workload through `pagedkv_driver.Replay` with the manager's entry points wrapped so
each kind of call is profiled on its own: decode `allocate_slots(req, 1)` (or
`allocate_decode_slots`), prefill `allocate_slots(req, n, hit, blocks)`, `get_computed_blocks`,
`free`, and hashing (request construction and token appends). Prints, per kind, the hottest
functions by own time with calls and microseconds per entry call, and writes the raw pstats
to benchmarks/results/. cProfile adds a fixed cost per Python call, so small functions look
heavier than they are: read the ranking, and take absolute times from the drivers.

  python benchmarks/peer/profile_pagedkv.py --workload decode
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import pagedkv_driver  # noqa: E402  (a sibling script, not a package)

WORKLOADS = {
    "decode": ["--workload", "decode"],
    "shared1": ["--workload", "shared-prefix", "--num-prefixes", "1"],
    "shared8": ["--workload", "shared-prefix", "--num-prefixes", "8"],
}
KINDS = ("decode_alloc", "prefill_alloc", "get_computed_blocks", "free", "hashing")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=list(WORKLOADS), default="decode")
    p.add_argument("--top", type=int, default=12, help="functions listed per kind")
    p.add_argument("--batched-decode", action="store_true")
    p.add_argument("--out-dir", default=str(HERE.parent / "results"))
    p.add_argument(
        "driver_args",
        nargs="*",
        help="extra pagedkv_driver arguments after --, e.g. -- --requests 256",
    )
    return p.parse_args(argv)


class PhaseProfiler:
    """Wraps the manager's entry points and the Request class with one profiler per kind."""

    def __init__(self) -> None:
        self.profiles = {kind: cProfile.Profile() for kind in KINDS}
        self.entry_calls = dict.fromkeys(KINDS, 0)

    def wrap(self, kind_of, method):
        profiles, entry_calls = self.profiles, self.entry_calls

        def wrapper(*args, **kwargs):
            kind = kind_of(args)
            entry_calls[kind] += 1
            prof = profiles[kind]
            prof.enable()
            try:
                return method(*args, **kwargs)
            finally:
                prof.disable()

        return wrapper

    def install(self, replay: pagedkv_driver.Replay) -> None:
        manager = replay.manager
        manager.allocate_slots = self.wrap(
            lambda a: "decode_alloc" if len(a) == 2 else "prefill_alloc", manager.allocate_slots
        )
        manager.get_computed_blocks = self.wrap(
            lambda a: "get_computed_blocks", manager.get_computed_blocks
        )
        manager.free = self.wrap(lambda a: "free", manager.free)
        if hasattr(manager, "allocate_decode_slots"):
            manager.allocate_decode_slots = self.wrap(
                lambda a: "decode_alloc", manager.allocate_decode_slots
            )
        # Hashing happens in Request construction and in append_output_token_ids. The methods
        # are wrapped on the class itself: a subclass would fail the manager's
        # `type(request) is Request` fast-path test and profile the slow path instead.
        request_cls = pagedkv_driver.Request
        for name in ("__init__", "append_output_token_ids"):
            setattr(request_cls, name, self.wrap(lambda a: "hashing", getattr(request_cls, name)))


def summarize(kind: str, prof: cProfile.Profile, entry_calls: int, top: int) -> list[str]:
    """Markdown table: the `top` functions by own time, with per-entry-call figures."""
    stats = pstats.Stats(prof)
    rows = []
    total_tt = 0.0
    for (filename, line, func), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():
        if "cProfile" in filename or func == "<method 'disable' of '_lsprof.Profiler' objects>":
            continue
        total_tt += tt
        short = filename.split("/src/")[-1] if "/src/" in filename else Path(filename).name
        name = f"{short}:{line}({func})" if line else func
        rows.append((tt, ct, ncalls, name))
    rows.sort(reverse=True)
    lines = [
        f"### {kind}: {entry_calls} entry calls, {1e6 * total_tt / max(entry_calls, 1):.2f} us "
        "per entry call under cProfile",
        "",
        "| function | own s | cum s | calls / entry call | own us / entry call |",
        "|---|---:|---:|---:|---:|",
    ]
    for tt, ct, ncalls, name in rows[:top]:
        lines.append(
            f"| `{name}` | {tt:.3f} | {ct:.3f} | {ncalls / max(entry_calls, 1):.2f} | "
            f"{1e6 * tt / max(entry_calls, 1):.2f} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    driver_argv = WORKLOADS[args.workload] + list(args.driver_args)
    if args.batched_decode:
        driver_argv.append("--batched-decode")
    replay = pagedkv_driver.Replay(pagedkv_driver.parse_args(driver_argv))
    profiler = PhaseProfiler()
    profiler.install(replay)
    wall = replay.run()
    report = replay.report(wall)
    assert report["free_check_ok"], report
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    print(f"## {args.workload}: pagedkv_driver.py {' '.join(driver_argv)}")
    print(
        f"(profiled run: manager {report['manager_seconds']:.3f} s, hashing "
        f"{report['hash_seconds']:.3f} s; cProfile inflates both)\n"
    )
    for kind in KINDS:
        if not profiler.entry_calls[kind]:
            continue
        pstats_path = out_dir / f"profile_{args.workload}_{kind}_{stamp}.pstats"
        profiler.profiles[kind].dump_stats(pstats_path)
        print(
            "\n".join(
                summarize(kind, profiler.profiles[kind], profiler.entry_calls[kind], args.top)
            )
        )
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
