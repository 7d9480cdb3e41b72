"""pytest plugin for .ci/vllm-suites: write every test's outcome as JSON (`--outcomes PATH`).

One entry per node id: "passed", "failed", "error" (setup or teardown failed) or "skipped".
`--outcome-details PATH` also writes, per failing test, the exception type, its message's
first line, the first traceback frame inside pagedkv and the last frame; and the seconds each
test file and each test of a second or more took (setup, call and teardown summed):
`{"failures": {nodeid: {...}}, "seconds_per_file": {path: s}, "seconds_per_test": {...}}`,
and the CPU seconds per file (`cpu_seconds_per_file`).
"""

import json
import time

import pytest

_OUTCOMES: dict[str, str] = {}
_FAILURES: dict[str, dict[str, str]] = {}
_SECONDS_PER_FILE: dict[str, float] = {}
_SECONDS_PER_TEST: dict[str, float] = {}
# CPU seconds (this process), which a busy machine inflates less than wall time.
_CPU_SECONDS_PER_FILE: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption("--outcomes", default=None, metavar="PATH")
    parser.addoption("--outcome-details", default=None, metavar="PATH")


def _frame(entry) -> str:
    return f"{entry.path}:{entry.lineno + 1} in {entry.name}"


def _failure(excinfo) -> dict[str, str]:
    message = str(excinfo.value).strip().splitlines()
    entries = list(excinfo.traceback)
    pagedkv = [
        e for e in entries if "/pagedkv/" in str(e.path) and "pytest_plugin" not in str(e.path)
    ]
    return {
        "type": excinfo.typename,
        "message": message[0][:300] if message else "",
        "pagedkv_frame": _frame(pagedkv[0]) if pagedkv else "",
        "last_frame": _frame(entries[-1]) if entries else "",
    }


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.process_time()
    yield
    path = item.nodeid.split("::", 1)[0]
    spent = time.process_time() - start
    _CPU_SECONDS_PER_FILE[path] = _CPU_SECONDS_PER_FILE.get(path, 0.0) + spent


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception):
        if item.nodeid not in _FAILURES:  # the first failure (setup or call) is the cause
            _FAILURES[item.nodeid] = {"when": call.when, **_failure(call.excinfo)}


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    nodeid = report.nodeid
    path = nodeid.split("::", 1)[0]
    _SECONDS_PER_FILE[path] = _SECONDS_PER_FILE.get(path, 0.0) + report.duration
    _SECONDS_PER_TEST[nodeid] = _SECONDS_PER_TEST.get(nodeid, 0.0) + report.duration
    if report.when == "call":
        _OUTCOMES[nodeid] = report.outcome
    elif report.failed:
        if _OUTCOMES.get(nodeid) != "failed":
            _OUTCOMES[nodeid] = "error"
    elif report.skipped and report.when == "setup":
        _OUTCOMES[nodeid] = "skipped"


def pytest_sessionfinish(session):
    path = session.config.getoption("--outcomes")
    if path:
        with open(path, "w") as f:
            json.dump(_OUTCOMES, f, indent=1, sort_keys=True)
    path = session.config.getoption("--outcome-details")
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "failures": _FAILURES,
                    "seconds_per_file": _SECONDS_PER_FILE,
                    "cpu_seconds_per_file": _CPU_SECONDS_PER_FILE,
                    # The slow ones only (the CI's time budget is spent there).
                    "seconds_per_test": {n: s for n, s in _SECONDS_PER_TEST.items() if s >= 1.0},
                },
                f,
                indent=1,
                sort_keys=True,
            )
