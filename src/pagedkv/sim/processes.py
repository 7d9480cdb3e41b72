"""Simulator layer: independent simulation jobs in forked worker processes, with progress.

A capacity sweep's points share nothing, so each runs in its own process (CPU-bound Python
gains nothing from threads). Workers are forked and inherit the jobs' arguments (a loaded trace
is never pickled); each talks to the parent over its own pipe (the parent sends a job's index,
the worker sends back its result) and reports progress through one shared counter. No lock is
shared, so the parent can always end a worker: on any error, Ctrl-C, SIGTERM or SIGHUP it kills
them all before raising. Workers ignore those signals (sent to the process group, they would
race the parent's clean-up) and, on Linux, die with the parent however it ends. Knows nothing
of what a job computes.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

ProgressCallback = Callable[[int], None]  # called with the number of requests done so far
JobProgress = Callable[[int], None]  # a job reports its own number of requests done
Result = TypeVar("Result")

_POLL_S = 0.1
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Signals the parent handles for its workers (they reach the workers too when sent to the
# process group, as a terminal's Ctrl-C is).
_PARENT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)


class WorkerDiedError(RuntimeError):
    """A worker process ended without a result (killed from outside, or out of memory)."""


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

    `report(n)` tells the parent that the job has done n of the trace's `num_requests`;
    `progress` gets the mean over the jobs. Any error in a job is raised here after every
    worker has been killed; so is anything raised in the parent meanwhile (`KeyboardInterrupt`
    and the CLI's signal shutdown included). No worker outlives the call.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    context = multiprocessing.get_context("fork")
    num_jobs = len(arguments)
    counters = context.Array("q", num_jobs, lock=False)
    results: list[Any] = [None] * num_jobs
    workers: list[tuple[Any, Any]] = []  # (process, the parent's end of its pipe)
    try:
        next_index = 0
        for _ in range(min(max_workers, num_jobs)):
            parent_end, worker_end = context.Pipe()
            process = context.Process(
                target=_work,
                args=(worker_end, job, arguments, counters, os.getpid()),
                daemon=True,
            )
            # A signal arriving mid-fork would be handled inside an at-fork hook, which swallows
            # exceptions (the parent would miss its Ctrl-C; the child would run the parent's
            # clean-up): held back until the fork is done, then delivered here.
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _PARENT_SIGNALS)
            try:
                process.start()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            worker_end.close()
            parent_end.send(next_index)
            next_index += 1
            workers.append((process, parent_end))
        busy = {parent_end: process for process, parent_end in workers}
        num_done = 0
        while num_done < num_jobs:
            for ready in wait(list(busy), timeout=_POLL_S):
                connection = cast("Connection", ready)
                index, value, error = _receive(connection, busy[connection])
                if error is not None:
                    raise error
                results[index] = value
                num_done += 1
                if next_index < num_jobs:
                    connection.send(next_index)
                    next_index += 1
                else:
                    connection.send(None)
                    del busy[connection]
            if progress is not None:
                progress(sum(counters) // num_jobs)
    finally:
        for process, _ in workers:
            if process.exitcode is None:
                process.kill()  # SIGKILL: a worker holds nothing the parent needs back
        for process, parent_end in workers:
            process.join()
            parent_end.close()
    if progress is not None:
        progress(num_requests)
    return results


def _receive(connection: Any, process: Any) -> tuple[int, Any, BaseException | None]:
    """(job index, result, None) or (index, None, the job's error) from a worker."""
    try:
        return connection.recv()
    except EOFError:
        process.join(1)
        raise WorkerDiedError(
            f"a simulation worker process (pid {process.pid}) ended without a result "
            f"(exit code {process.exitcode}: killed from outside, or out of memory?)"
        ) from None


def _work(
    connection: Any,
    job: Callable[[Any, JobProgress], Any],
    arguments: Sequence[Any],
    counters: Any,
    parent_pid: int,
) -> None:
    """A worker's loop: run the job whose index arrives, send back its outcome; None ends it."""
    for signum in _PARENT_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _PARENT_SIGNALS)  # blocked by the parent's fork
    _end_with_parent(parent_pid)
    while True:
        try:
            index = connection.recv()
        except EOFError:  # the parent is gone
            return
        if index is None:
            return

        def report(num_done: int, index: int = index) -> None:
            counters[index] = num_done

        try:
            outcome: tuple[int, Any, BaseException | None] = (
                index,
                job(arguments[index], report),
                None,
            )
        except Exception as exc:  # noqa: BLE001 - raised again in the parent
            outcome = (index, None, _rebuildable(exc))
        try:
            connection.send(outcome)  # pickled whole before anything is written
        except Exception as exc:  # noqa: BLE001 - an unpicklable result
            connection.send((index, None, RuntimeError(f"job {index}'s result: {exc}")))


def _rebuildable(error: Exception) -> Exception:
    """The error itself, or its text where the parent could not rebuild it (an exception whose
    constructor takes other arguments than its message fails to unpickle)."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:  # noqa: BLE001 - any failure means "send the text instead"
        return RuntimeError(f"{type(error).__name__}: {error}")
    return error


def _end_with_parent(parent_pid: int) -> None:
    """Linux: have the kernel kill this worker when its parent ends (even by SIGKILL), so no
    worker outlives the run. Elsewhere nothing (the pipe closes; an idle worker then exits)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # libc, already loaded
    except (OSError, AttributeError):
        return
    prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent ended before the request took effect
        os._exit(1)
