"""pytest plugin: run vLLM's own tests with pagedkv as vLLM's KV-cache manager.

Load it with `-p pagedkv.integrations.vllm.pytest_plugin`. At `pytest_configure`, before any
test module is imported, it rebinds `vllm.v1.core.kv_cache_manager.KVCacheManager` to a
counting subclass of `PagedKVCacheManager`, so every later `from vllm.v1.core.kv_cache_manager
import KVCacheManager` (vLLM's test modules', vLLM's scheduler's) binds pagedkv's class, and
sweeps the modules already imported (vLLM's scheduler, the conftests) for globals holding
vLLM's class; a second sweep runs when collection ends. It counts, per test, the schedulers,
pagedkv managers and vLLM managers built, so a swap that silently did nothing shows: each
count becomes a junit `property`, and `--pagedkv-report PATH` writes them all as JSON
(`{nodeid: {"schedulers": n, "pagedkv_managers": n, "vllm_managers": n}}`).

`--pagedkv-manager vllm` only counts (vLLM's manager stays): the baseline run of
.ci/vllm-suites uses it to learn which tests build a manager at all. `--pagedkv-eviction
POLICY` builds every pagedkv manager with that eviction policy (as
`additional_config["pagedkv"]["eviction"]` would), to run vLLM's suites on a non-LRU order.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Generator
from typing import Any

import pytest

COUNTS = {"schedulers": 0, "pagedkv_managers": 0, "vllm_managers": 0}
_REPORT: dict[str, dict[str, int]] = {}
# "module.attribute" names whose vLLM manager class was replaced by pagedkv's: at configure
# time, and by the sweep after collection.
REBOUND: list[str] = []
REBOUND_AFTER_COLLECTION: list[str] = []


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--pagedkv-report",
        default=None,
        metavar="PATH",
        help="write the per-test counts of schedulers and KV-cache managers built as JSON",
    )
    parser.addoption(
        "--pagedkv-manager",
        default="pagedkv",
        choices=("pagedkv", "vllm"),
        help="the KV-cache manager vLLM builds: pagedkv's (default) or vLLM's own (count only)",
    )
    parser.addoption(
        "--pagedkv-eviction",
        default=None,
        metavar="POLICY",
        help="build pagedkv's managers with this eviction policy (default: lru, vLLM's order)",
    )


def _counting(klass: type, key: str) -> None:
    """Wrap `klass.__init__` so each construction increments `COUNTS[key]`."""
    original = getattr(klass, "__init__")  # noqa: B009 (mypy refuses klass.__init__)

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        COUNTS[key] += 1
        original(self, *args, **kwargs)

    setattr(klass, "__init__", __init__)  # noqa: B010


def _rebind_everywhere(original: type, replacement: type) -> list[str]:
    """Point every module global that is `original` at `replacement`; the names rebound.

    This module's own globals are skipped (`_SWAP` keeps both classes).
    """
    rebound = []
    for module_name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict) or module_name == __name__:
            continue
        for attribute, value in list(namespace.items()):
            if value is original:
                namespace[attribute] = replacement
                rebound.append(f"{module_name}.{attribute}")
    return rebound


# (vLLM's manager class, the counting pagedkv class) once swapped.
_SWAP: list[type] = []


def pytest_configure(config: pytest.Config) -> None:
    from vllm.v1.core import kv_cache_manager as vllm_manager
    from vllm.v1.core.sched import scheduler as vllm_scheduler

    _counting(vllm_scheduler.Scheduler, "schedulers")
    _counting(vllm_manager.KVCacheManager, "vllm_managers")
    if config.getoption("--pagedkv-manager") == "vllm":
        return

    from pagedkv.integrations.vllm.manager import PagedKVCacheManager
    from pagedkv.integrations.vllm.options import DEFAULT_OPTIONS, parse_options

    policy = config.getoption("--pagedkv-eviction")
    options = DEFAULT_OPTIONS
    if policy is not None:
        options = parse_options({"pagedkv": {"eviction": policy}})

    class CountedPagedKVCacheManager(PagedKVCacheManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            COUNTS["pagedkv_managers"] += 1
            if options is not DEFAULT_OPTIONS:
                kwargs.setdefault("pagedkv_options", options)
            super().__init__(*args, **kwargs)

    _SWAP[:] = [vllm_manager.KVCacheManager, CountedPagedKVCacheManager]
    # vllm.v1.core.kv_cache_manager's own global among them: test modules imported later bind
    # ours.
    REBOUND.extend(_rebind_everywhere(*_SWAP))
    if f"{vllm_manager.__name__}.KVCacheManager" not in REBOUND:
        raise pytest.UsageError("pagedkv: vLLM's KVCacheManager class was not found to rebind")


def pytest_collection_finish(session: pytest.Session) -> None:
    # Anything imported during collection that kept vLLM's class by another path.
    if _SWAP:
        REBOUND_AFTER_COLLECTION.extend(_rebind_everywhere(*_SWAP))


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
    if config.getoption("--pagedkv-manager") == "vllm":
        return "pagedkv: counting vLLM's KV-cache managers (vLLM's manager, not swapped)"
    return (
        "pagedkv: vLLM's KVCacheManager is pagedkv.integrations.vllm.PagedKVCacheManager "
        f"(rebound: {', '.join(REBOUND)})"
    )


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if REBOUND_AFTER_COLLECTION:
        terminalreporter.write_line(
            f"pagedkv: rebound after collection: {', '.join(REBOUND_AFTER_COLLECTION)}"
        )
