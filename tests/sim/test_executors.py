"""`pagedkv.sim.executors`: this process, forked workers and a local Ray (extra [ray]) give the
same results in task order; errors come back as their own type; shared inputs travel once."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidArgumentError
from pagedkv.sim.executors import LocalExecutor, RayExecutor
from pagedkv.sim.processes import can_fork
from tests.support.ray import ray_workers_import_tests

SHARED = [list(range(1000)), {"offset": 7}]
TASKS = [(0, 3), (1, 5), (0, 999), (1, -7), (0, 0)]
EXPECTED = [3, 12, 999, 0, 0]


def pick(shared, argument, report):
    """shared[argument] for a list, argument + offset for a dict."""
    report(1)
    if isinstance(shared, list):
        return shared[argument]
    return argument + shared["offset"]


def refuse_five(shared, argument, report):
    if argument == 5:
        raise InvalidArgumentError(f"cell {argument} refused")
    return argument


def call_shared(shared, argument, report):
    return shared(argument)


@pytest.mark.parametrize("max_workers", [1, 2])
def test_local_results_in_task_order_and_progress_counts_cells(max_workers):
    seen: list[int] = []
    assert LocalExecutor(max_workers).run(pick, SHARED, TASKS, seen.append) == EXPECTED
    assert seen[-1] == len(TASKS) and seen == sorted(seen)


@pytest.mark.parametrize("max_workers", [1, 2])
def test_local_error_is_raised_with_its_type(max_workers):
    with pytest.raises(InvalidArgumentError, match="cell 5 refused"):
        LocalExecutor(max_workers).run(refuse_five, SHARED, TASKS)


@pytest.mark.skipif(not can_fork(), reason="worker processes are forked")
def test_forked_workers_inherit_the_shared_inputs_unpickled():
    # A lambda cannot be pickled: a worker can only have it by inheriting it.
    shared = [lambda value: value * 10]
    assert LocalExecutor(2).run(call_shared, shared, [(0, 1), (0, 2), (0, 3)]) == [10, 20, 30]


def test_local_refuses_a_bad_worker_count():
    with pytest.raises(InvalidArgumentError, match="max_workers must be an int >= 1, got 0"):
        LocalExecutor(0)


@pytest.fixture(scope="module")
def ray():
    ray = pytest.importorskip("ray")
    with ray_workers_import_tests():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield ray
    ray.shutdown()


def test_ray_gives_the_local_results_and_puts_each_shared_input_once(ray, monkeypatch):
    put_values = []
    real_put = ray.put

    def counting_put(value, *args, **kwargs):
        put_values.append(value)
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(ray, "put", counting_put)
    seen: list[int] = []
    assert RayExecutor().run(pick, SHARED, TASKS, seen.append) == EXPECTED
    assert put_values == SHARED  # once each, not once per task
    assert seen[0] == 0 and seen[-1] == len(TASKS) and seen == sorted(seen)
    assert ray.is_initialized()  # a Ray it did not start stays up


def test_ray_raises_a_cells_error_as_its_own_type(ray):
    with pytest.raises(InvalidArgumentError, match="cell 5 refused"):
        RayExecutor().run(refuse_five, SHARED, TASKS)
