"""`pagedkv.sim.processes.run_jobs`: results in order, progress, errors stop every worker."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.processes import can_fork, run_jobs

pytestmark = pytest.mark.skipif(not can_fork(), reason="worker processes are forked")


def square_reporting(argument: int, report) -> int:
    for done in range(1, 11):
        report(done)
    return argument * argument


def fail_on_three(argument: int, report) -> int:
    if argument == 3:
        raise InvalidArgumentError(f"job {argument} refused")
    return argument


def test_results_in_order_and_progress_reaches_the_total():
    seen: list[int] = []
    assert run_jobs(square_reporting, [4, 1, 3, 2], 2, 10, seen.append) == [16, 1, 9, 4]
    assert seen[-1] == 10 and seen == sorted(seen)


def test_a_failing_job_raises_its_error_in_the_parent():
    with pytest.raises(InvalidArgumentError, match="job 3 refused"):
        run_jobs(fail_on_three, [1, 2, 3, 4], 2, 1)
