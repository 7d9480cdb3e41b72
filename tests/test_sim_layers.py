"""Imports point down: core ← sched ← sim ← cli; optional extras only inside functions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pagedkv

PACKAGE = Path(pagedkv.__file__).parent
EXTRAS = {"rich", "matplotlib", "numpy", "torch", "msgspec", "zmq", "prometheus_client", "redis"}


def module_level_imports(path: Path) -> set[str]:
    """Top-level modules imported outside functions (TYPE_CHECKING blocks excluded)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_sched_and_sim_import_downward_only():
    for layer, forbidden in (("sched", ("pagedkv.sim", "pagedkv.cli")), ("sim", ("pagedkv.cli",))):
        for path in sorted((PACKAGE / layer).glob("*.py")):
            for name in module_level_imports(path):
                assert not name.startswith(forbidden), f"{path.name} imports {name}"
                assert name.split(".")[0] not in EXTRAS, f"{path.name} imports {name} eagerly"
    for path in sorted(PACKAGE.glob("*.py")):
        for name in module_level_imports(path):
            assert not name.startswith(("pagedkv.sched", "pagedkv.sim")), f"core {path.name}"


def test_simulate_command_imports_only_the_standard_library():
    code = (
        "import sys, pagedkv.cli.simulate; "
        "print(sorted(m for m in sys.modules if m.startswith(('pagedkv.sim', 'pagedkv.sched', "
        "'rich', 'matplotlib'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
