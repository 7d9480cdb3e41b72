"""The torch engine is an adapter: nothing below it imports it, and only it imports torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pagedkv

PACKAGE = Path(pagedkv.__file__).parent
HEAVY = ("torch", "transformers")


def module_level_imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_only_the_engine_imports_torch_and_nothing_below_imports_the_engine():
    engine_dir = PACKAGE / "engine"
    for path in sorted(PACKAGE.rglob("*.py")):
        if engine_dir in path.parents:
            continue
        for name in module_level_imports(path):
            relative = path.relative_to(PACKAGE)
            assert name.split(".")[0] not in HEAVY, f"{relative} imports {name} eagerly"
            assert not name.startswith("pagedkv.engine"), f"{relative} imports {name} eagerly"
    for path in sorted(engine_dir.glob("*.py")):
        for name in module_level_imports(path):
            assert not name.startswith(("pagedkv.sim", "pagedkv.cli")), f"{path.name}: {name}"


def test_generate_command_imports_only_the_standard_library():
    code = (
        "import sys, pagedkv.cli.generate; "
        "print(sorted(m for m in sys.modules if m.startswith(('pagedkv.engine', 'torch', "
        "'transformers'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
