#!/usr/bin/env python3
"""Run a driver with its timers on the thread's CPU clock instead of the wall clock.

  python cpu_clock.py DRIVER.py [driver arguments...]

Both drivers time every manager call with `time.perf_counter`, so on a machine shared with
other busy processes every call also counts the time the process sat descheduled. This shim
replaces `time.perf_counter` by `time.thread_time` (CLOCK_THREAD_CPUTIME_ID) before the driver
is executed, so its `from time import perf_counter` picks the CPU clock up, and adds to the
driver's JSON line `"clock": {"name": "thread_time", "overhead_us": ...}`: the median cost of one
timed empty interval, which `run_compare.py --clock cpu` subtracts from every µs-per-call
figure (the CPU clock is a system call, several times dearer than perf_counter).
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import statistics
import sys
import time


def empty_interval_us(clock, samples: int = 20001) -> float:
    """Median of `clock() - clock()` back to back: what timing an empty call reports."""
    deltas = []
    for _ in range(samples):
        t0 = clock()
        deltas.append(clock() - t0)
    return 1e6 * statistics.median(deltas)


def main() -> int:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    driver = sys.argv[1]
    clock = time.thread_time
    overhead_us = empty_interval_us(clock)
    time.perf_counter = clock  # read by the driver's `from time import perf_counter`
    sys.argv = [driver, *sys.argv[2:]]
    out = io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out):
        try:
            runpy.run_path(driver, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    lines = out.getvalue().strip().splitlines()
    if not lines:
        return code or 1
    result = json.loads(lines[-1])
    result["clock"] = {"name": "thread_time", "overhead_us": round(overhead_us, 4)}
    print(json.dumps(result))
    return code


if __name__ == "__main__":
    sys.exit(main())
