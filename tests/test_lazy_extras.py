"""Optional extras load only when used: no module imports one at import time except the torch
engine (which is itself imported by nobody below it), and the CLI commands start with the
standard library alone. Layer direction is `test_imports.py`'s job."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import pagedkv

PACKAGE = Path(pagedkv.__file__).parent
EXTRAS = {
    "aiohttp",
    "cbor2",
    "matplotlib",
    "msgspec",
    "numpy",
    "prometheus_client",
    "pyarrow",
    "ray",
    "redis",
    "rich",
    "torch",
    "transformers",
    "triton",
    "vllm",
    "xxhash",
    "zmq",
}
# Extras a package (or one file) may import at module level: the engine is the torch adapter;
# its Triton kernels module is imported only when the triton backend is asked for; the vLLM
# integration is imported only by vLLM (its scheduler class, its pytest plugin); serve mode on
# vLLM's scheduler only by `simulate --scheduler vllm` (inside a function).
EAGER_ALLOWED = {
    "engine": {"torch", "transformers"},
    "engine/triton_kernels.py": {"torch", "triton"},
    "integrations": {"vllm", "torch"},
    "sim/vllm_serve.py": {"vllm", "torch"},
}


def module_level_imports(path: Path) -> set[str]:
    """Modules imported outside functions (TYPE_CHECKING blocks are inside `if`, so skipped)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_extras_are_imported_lazily_everywhere_but_the_engine():
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        allowed = EAGER_ALLOWED.get(relative.as_posix()) or EAGER_ALLOWED.get(
            relative.parts[0], set()
        )
        for name in module_level_imports(path):
            top = name.split(".")[0]
            if top in EXTRAS and top not in allowed:
                problems.append(f"{relative} imports {name} at import time")
            if name.startswith("pagedkv.engine") and relative.parts[0] != "engine":
                problems.append(f"{relative} imports {name} at import time")
    assert problems == []


@pytest.mark.parametrize(
    ("command_module", "prefixes"),
    [
        ("simulate", ("pagedkv.sim", "pagedkv.sched", "rich", "matplotlib")),
        ("generate", ("pagedkv.engine", "torch", "transformers")),
        ("events", ("pagedkv.wire", "pagedkv.wire.transport", "msgspec", "zmq")),
        ("size", ("pagedkv.sizing", "pagedkv.sizing.model_config")),
        ("router", ("pagedkv.router.service", "pagedkv.router.feeds", "aiohttp", "zmq")),
    ],
)
def test_cli_commands_import_only_the_standard_library(command_module, prefixes):
    code = (
        f"import sys, pagedkv.cli.{command_module}; "
        f"print(sorted(m for m in sys.modules if m.startswith({prefixes!r})))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
