"""Simulator layer: where a sweep's cells run: this process, forked worker processes, or Ray.

A cell is `job(shared[i], argument, report)`: a module-level function, one of a few large
shared inputs (a loaded trace) and a small argument. Every executor returns the results in
the order of the tasks, so a sweep's report does not depend on where it ran. Knows nothing of
what a job computes. Ray (extra `[ray]`) is imported only by `RayExecutor`.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pagedkv.errors import InvalidArgumentError

JobProgress = Callable[[int], None]  # a job may report its own progress (ignored here)
CellJob = Callable[[Any, Any, JobProgress], Any]
CellsDone = Callable[[int], None]  # called with the number of cells done so far
Task = tuple[int, Any]  # (index into `shared`, argument)

_POLL_S = 0.1
_worker_shared: Sequence[Any] = ()  # a forked worker's view of the shared inputs


class Executor(Protocol):
    def run(
        self,
        job: CellJob,
        shared: Sequence[Any],
        tasks: Sequence[Task],
        progress: CellsDone | None = None,
    ) -> list[Any]:
        """`[job(shared[i], argument, report) for i, argument in tasks]`, in task order."""
        ...


def _ignore(num_done: int) -> None:
    pass


class LocalExecutor:
    """This machine: in this process (`max_workers == 1`, or where fork is missing), else in
    up to `max_workers` forked processes, which inherit the shared inputs (nothing is pickled
    but the small arguments and the results). An error in a cell stops every worker and is
    raised here; Ctrl-C reaches the parent only."""

    def __init__(self, max_workers: int) -> None:
        if type(max_workers) is not int or max_workers < 1:
            raise InvalidArgumentError(f"max_workers must be an int >= 1, got {max_workers!r}")
        self.max_workers = max_workers

    def run(
        self,
        job: CellJob,
        shared: Sequence[Any],
        tasks: Sequence[Task],
        progress: CellsDone | None = None,
    ) -> list[Any]:
        from pagedkv.sim.processes import can_fork

        if self.max_workers == 1 or len(tasks) < 2 or not can_fork():
            results = []
            for index, argument in tasks:
                results.append(job(shared[index], argument, _ignore))
                if progress is not None:
                    progress(len(results))
            return results
        return self._run_forked(job, shared, tasks, progress)

    def _run_forked(
        self,
        job: CellJob,
        shared: Sequence[Any],
        tasks: Sequence[Task],
        progress: CellsDone | None,
    ) -> list[Any]:
        import multiprocessing

        global _worker_shared
        _worker_shared = shared  # inherited by the forked workers, never pickled
        context = multiprocessing.get_context("fork")
        pool = context.Pool(min(self.max_workers, len(tasks)), _init_worker)
        try:
            pending = [pool.apply_async(_run_forked_task, (job, task)) for task in tasks]
            num_done = -1
            while num_done < len(pending):
                done = sum(1 for result in pending if result.ready())
                if progress is not None and done != num_done:
                    progress(done)
                num_done = done
                if num_done < len(pending):
                    time.sleep(_POLL_S)
            results = [result.get() for result in pending]
        except BaseException:
            pool.terminate()
            raise
        else:
            pool.close()
        finally:
            pool.join()
            _worker_shared = ()
        return results


def _init_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C


def _run_forked_task(job: CellJob, task: Task) -> Any:
    index, argument = task
    return job(_worker_shared[index], argument, _ignore)


class RayExecutor:
    """A Ray cluster: each cell one Ray task (one CPU). Each shared input is put in Ray's
    object store once (`ray.put`) and every task gets its reference, so a trace travels to
    each node once, not with every task. Connects to `address` (`ray.init(address=...)`; None
    starts a local Ray with `num_cpus`, or joins the one this process already started) and
    shuts down only a Ray it started. A cell's error is raised here as its own type."""

    def __init__(self, address: str | None = None, num_cpus: int | None = None) -> None:
        self.address = address
        self.num_cpus = num_cpus

    def run(
        self,
        job: CellJob,
        shared: Sequence[Any],
        tasks: Sequence[Task],
        progress: CellsDone | None = None,
    ) -> list[Any]:
        import ray

        started_here = not ray.is_initialized()
        if started_here:
            ray.init(
                address=self.address,
                num_cpus=self.num_cpus if self.address is None else None,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
                configure_logging=False,
            )
        pending: list[Any] = []
        try:
            refs = [ray.put(value) for value in shared]
            remote = ray.remote(num_cpus=1)(_run_ray_task)
            pending = [remote.remote(job, refs[index], argument) for index, argument in tasks]
            if progress is not None:
                progress(0)
            remaining = list(pending)
            while remaining:
                ready, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=_POLL_S)
                if ready and progress is not None:
                    progress(len(pending) - len(remaining))
            try:
                return list(ray.get(pending))
            except ray.exceptions.RayTaskError as exc:
                # The cell's own exception (a PagedKVError stays one), not Ray's wrapper.
                cause = getattr(exc, "cause", None)
                raise (cause if isinstance(cause, Exception) else exc) from None
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        finally:
            if started_here:
                ray.shutdown()


def _run_ray_task(job: CellJob, shared_value: Any, argument: Any) -> Any:
    # Ray resolves the top-level object reference: `shared_value` is the input itself.
    return job(shared_value, argument, _ignore)


def ray_available() -> bool:
    """Whether Ray is importable here (the `[ray]` extra)."""
    from importlib.util import find_spec

    return find_spec("ray") is not None
