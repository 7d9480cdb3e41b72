"""pytest plugin: run vLLM's own tests with pagedkv as the KV-cache manager of vLLM's Scheduler.

Load it with `-p pagedkv.integrations.vllm.pytest_plugin`. It rebinds the manager class inside
`vllm.v1.core.sched.scheduler` for the whole session and counts, per test, the schedulers built,
the pagedkv managers built and the vLLM managers built, so a swap that silently did nothing
shows: each count becomes a junit `property`, and `--pagedkv-report PATH` writes them all as
JSON (`{nodeid: {"schedulers": n, "pagedkv_managers": n, "vllm_managers": n}}`).
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import pytest

COUNTS = {"schedulers": 0, "pagedkv_managers": 0, "vllm_managers": 0}
_REPORT: dict[str, dict[str, int]] = {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pagedkv-report",
        default=None,
        metavar="PATH",
        help="write the per-test counts of schedulers and KV-cache managers built as JSON",
    )


def _counting(klass: type, key: str) -> None:
    """Wrap `klass.__init__` so each construction increments `COUNTS[key]`."""
    original = getattr(klass, "__init__")  # noqa: B009 (mypy refuses klass.__init__)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        COUNTS[key] += 1
        original(self, *args, **kwargs)

    setattr(klass, "__init__", __init__)  # noqa: B010


def pytest_configure(config: pytest.Config) -> None:
    from vllm.v1.core import kv_cache_manager as vllm_manager
    from vllm.v1.core.sched import scheduler as vllm_scheduler

    from pagedkv.integrations.vllm.manager import PagedKVCacheManager

    class CountedPagedKVCacheManager(PagedKVCacheManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            COUNTS["pagedkv_managers"] += 1
            super().__init__(*args, **kwargs)

    _counting(vllm_scheduler.Scheduler, "schedulers")
    _counting(vllm_manager.KVCacheManager, "vllm_managers")
    # As in scheduler.py: vLLM types the global as its own manager class.
    vllm_scheduler.KVCacheManager = CountedPagedKVCacheManager  # type: ignore[assignment, misc, unused-ignore]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator:
    for key in COUNTS:
        COUNTS[key] = 0
    yield
    counts = dict(COUNTS)
    _REPORT[item.nodeid] = counts


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator:
    outcome: Any = yield
    if call.when == "teardown":
        report = outcome.get_result()
        for key, value in COUNTS.items():
            report.user_properties.append((key, value))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("--pagedkv-report")
    if path:
        with open(path, "w") as f:
            json.dump(_REPORT, f, indent=1, sort_keys=True)


def pytest_report_header(config: pytest.Config) -> str:
    return "pagedkv: vLLM's Scheduler builds pagedkv.integrations.vllm.PagedKVCacheManager"
