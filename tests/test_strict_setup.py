"""`make test` turns a skip for something it installs into a failure
(tests/support/strict_setup.py)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]
QUIET = ("-p", "no:hypothesispytest", "-p", "no:anyio", "-p", "no:cacheprovider")  # start fast

CASES = {
    "test_module_skip.py": "import pytest\npytest.importorskip('no_such_module_pagedkv')\n"
    "def test_x():\n    pass\n",
    "test_cases.py": "import pytest\n"
    "def test_needs_redis():\n    pytest.skip('redis-server is not installed (apt-get ...)')\n"
    "def test_needs_package():\n    pytest.importorskip('no_such_module_pagedkv')\n"
    "def test_needs_a_gpu():\n    pytest.skip('needs a CUDA device')\n"
    "def test_passes():\n    pass\n",
}


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest("from tests.support.strict_setup import *  # noqa: F403\n")
    for name, source in CASES.items():
        pytester.makepyfile(**{name.removesuffix(".py"): source})
    return pytester


def test_setup_skips_fail_under_the_test_command(suite, monkeypatch):
    monkeypatch.setenv("PAGEDKV_REQUIRE_TEST_DEPS", "1")
    result = suite.runpytest_inprocess("-rA", *QUIET)
    result.assert_outcomes(passed=1, failed=2, skipped=2)  # the module and the GPU test
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(  # in the order pytest prints them
        [
            "*modules skipped for lack of what `make test` installs*",
            "test_module_skip.py: Skipped: could not import 'no_such_module_pagedkv'*",
            "SKIPPED*test_cases.py*needs a CUDA device",
            "FAILED*test_needs_redis*",
            "FAILED*test_needs_package*",
        ]
    )


def test_setup_skips_stay_skips_otherwise(suite, monkeypatch):
    monkeypatch.delenv("PAGEDKV_REQUIRE_TEST_DEPS", raising=False)
    result = suite.runpytest_inprocess(*QUIET)
    result.assert_outcomes(passed=1, skipped=4)
