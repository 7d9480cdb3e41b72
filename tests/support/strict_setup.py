"""Test helper (pytest hooks, imported by conftest.py): under `make test` nothing that command
installs may be missing, so a skip for lack of it is a failure.

`make test` sets PAGEDKV_REQUIRE_TEST_DEPS=1. A test that skips because a Python package cannot
be imported (`pytest.importorskip`) or something "is not installed" (redis-server) then fails,
naming what is missing; a module that skips so at import fails the run (exit status 1, listed
in the summary). Other skips (no GPU, say) stay skips.
"""

from __future__ import annotations

import os

import pytest

# `pytest.importorskip`, and our helpers' "redis-server is not installed", "triton is not ...".
SETUP_SKIP_REASONS = ("could not import", "is not installed")
_HINT = "PAGEDKV_REQUIRE_TEST_DEPS=1 (`make test`): what the test command installs must be there"
_skipped_modules: list[str] = []


def _required() -> bool:
    return os.environ.get("PAGEDKV_REQUIRE_TEST_DEPS") == "1"


def _setup_skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str | None:
    if not report.skipped or hasattr(report, "wasxfail"):
        return None
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason if any(marker in reason for marker in SETUP_SKIP_REASONS) else None


def pytest_sessionstart(session):  # noqa: ARG001 - the hook's signature
    _skipped_modules.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):  # noqa: ARG001 - the hook's signature
    outcome = yield
    report = outcome.get_result()
    if _required() and (reason := _setup_skip_reason(report)):
        report.outcome = "failed"
        report.longrepr = f"{reason}\n({_HINT})"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):  # noqa: ARG001 - the hook's signature
    outcome = yield
    report = outcome.get_result()
    if _required() and (reason := _setup_skip_reason(report)):
        # Kept a skip, so the other modules still run; the session fails at its end.
        _skipped_modules.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session, exitstatus):
    if _skipped_modules and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    if _skipped_modules:
        terminalreporter.section("modules skipped for lack of what `make test` installs", red=True)
        for line in _skipped_modules:
            terminalreporter.line(line)
        terminalreporter.line(_HINT)
