"""Simulator layer: independent simulation jobs in forked worker processes, with progress.

A capacity sweep's points share nothing, so each runs in its own process (CPU-bound Python
gains nothing from threads). Workers are forked, so they inherit the loaded trace instead of
unpickling it, ignore Ctrl-C (the parent stops them all), and report progress through one
shared counter each. Knows nothing of what a job computes.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

ProgressCallback = Callable[[int], None]  # called with the number of requests done so far
JobProgress = Callable[[int], None]  # a job reports its own number of requests done
Result = TypeVar("Result")

_POLL_S = 0.1
_worker_counters: Any = None  # set in each worker process by _init_worker


def default_max_workers() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on every platform
        return os.cpu_count() or 1


def can_fork() -> bool:
    """Whether worker processes can be forked here (not on Windows)."""
    import multiprocessing  # only here: ~45 ms to import

    return "fork" in multiprocessing.get_all_start_methods()


def run_jobs(
    job: Callable[[Any, JobProgress], Result],
    arguments: Sequence[Any],
    max_workers: int,
    num_requests: int,
    progress: ProgressCallback | None = None,
) -> list[Result]:
    """`[job(argument, report) for argument in arguments]`, in up to `max_workers` processes.

    `job` must be a module-level function (it is sent to the workers by name); `report(n)`
    tells the parent that the job has done n of the trace's `num_requests`. `progress` gets
    the mean over the jobs. Any error in a job is raised here after every worker is stopped.
    """
    import multiprocessing

    context = multiprocessing.get_context("fork")
    counters = context.Array("q", len(arguments), lock=False)
    pool = context.Pool(min(max_workers, len(arguments)), _init_worker, (counters,))
    try:
        pending = [
            pool.apply_async(_run_job, (job, index, argument))
            for index, argument in enumerate(arguments)
        ]
        while not all(result.ready() for result in pending):
            time.sleep(_POLL_S)
            if progress is not None:
                progress(sum(counters) // len(arguments))
        results = [result.get() for result in pending]
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()
    if progress is not None:
        progress(num_requests)
    return results


def _init_worker(counters: Any) -> None:
    global _worker_counters
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C
    _worker_counters = counters


def _run_job(job: Callable[[Any, JobProgress], Result], index: int, argument: Any) -> Result:
    counters = _worker_counters

    def report(num_done: int) -> None:
        counters[index] = num_done

    return job(argument, report)
