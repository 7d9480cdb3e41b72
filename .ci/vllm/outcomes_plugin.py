"""pytest plugin for .ci/vllm-suites: write every test's outcome as JSON (`--outcomes PATH`).

One entry per node id: "passed", "failed", "error" (setup or teardown failed) or "skipped".
"""

import json

import pytest

_OUTCOMES: dict[str, str] = {}


def pytest_addoption(parser):
    parser.addoption("--outcomes", default=None, metavar="PATH")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report):
    nodeid = report.nodeid
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
