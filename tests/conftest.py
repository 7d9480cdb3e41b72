"""pytest set-up for the whole suite: the strict-setup hooks of `make test`, the Triton
interpreter for the kernel tests, and the `manager` fixture.

The suite is a package (`tests`, one subpackage per area); shared builders and helpers live in
`tests.support` and are imported from there by absolute name.
"""

from __future__ import annotations

import os

import pytest

from tests.support.strict_setup import (  # noqa: F401 - pytest hooks of `make test`
    pytest_make_collect_report,
    pytest_runtest_makereport,
    pytest_sessionfinish,
    pytest_sessionstart,
    pytest_terminal_summary,
)

# The engine's Triton kernels run in Triton's interpreter in tests (set before anything imports
# triton; building a transformers model does). PAGEDKV_TEST_GPU=1 compiles them for a GPU.
if not os.environ.get("PAGEDKV_TEST_GPU"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedkv import KVCacheManager
from tests.support.builders import make_manager


@pytest.fixture
def manager() -> KVCacheManager:
    """The 11-block, block-size-16 manager of the reference's `test_prefill`."""
    return make_manager(11, 16)
