"""Import hygiene, checked by parsing every module under src/pagedkv (nothing is imported).

(a) The core (top-level modules and managers/) imports only the standard library and pagedkv at
    import time; optional extras may be imported lazily, inside functions, only where listed.
(b) Imports point down the layer order (type-only imports under TYPE_CHECKING are exempt):
    leaves -> block_pool -> managers -> coordinators -> kv_cache_manager -> sched -> sim -> cli;
    inside a package, a subpackage or module LAYERS names by its dotted key has its own rank
    (sim.inputs -> sim -> sim.cluster -> sim.report).
(c) CLI command modules import only the standard library and pagedkv at import time.

A new top-level module or package must be placed in LAYERS (the test says so), which keeps the
order a decision instead of an accident.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "src" / "pagedkv"

# Rank of every top-level module or package of pagedkv. A module may import modules of a lower
# or equal rank (equal: sideways, e.g. between leaves or within one package), never higher.
LAYERS: dict[str, int] = {
    # leaves
    "errors": 0,
    "memory_guard": 1,  # this machine's memory guard: estimates, what is left, check_fits
    "block": 1,
    "specs": 1,
    "stats": 1,
    "events": 2,
    "free_queue": 2,
    "hashing": 2,
    "retention": 2,  # per-request retention hints (plain data)
    "canonical_cbor": 1,  # sha256_cbor's payload encoder (errors only)
    "credentials": 0,  # redact(): passwords out of every message (stdlib only)
    "owner_thread": 1,  # the single-owner thread rule (errors only)
    "atomic_file": 1,  # output files that appear whole (stdlib only)
    "bounded_read": 2,  # input read within a byte budget, any file type
    "request": 3,
    "sizing": 4,  # model configs -> per-layer specs -> KVCacheConfig (stdlib)
    "eviction": 6,  # eviction policies, retention levels, host tier (stdlib): the pool's order
    # the pool and what sits on it
    "block_pool.entries": 7,  # the hash maps' entries: duplicates, further keys (functions)
    "block_pool.checks": 8,  # the pool's argument and invariant checks (functions)
    "block_pool.events": 8,  # the pool's BlockStored event building (functions)
    "block_pool": 10,  # BlockPool (block_pool/pool.py) and the package's surface
    "managers": 20,
    "coordinators": 30,
    "kv_cache_blocks": 4,  # the facade's result types (block + errors only)
    "kv_cache_manager.checks": 35,  # the facade's argument checks
    "kv_cache_manager.events": 35,  # the BlockStored annotation (also the vLLM adapter's)
    "kv_cache_manager": 40,  # KVCacheManager (kv_cache_manager/manager.py), the surface
    "__init__": 45,  # the package root re-exports the core
    # above the core
    "sched": 50,
    "wire": 52,  # codec, snapshot (stdlib), transport (ZeroMQ)
    "metrics": 54,  # residency (stdlib), Prometheus export
    "router": 54,
    "engine": 54,
    "integrations": 56,  # pagedkv inside other engines (vLLM): the core and the wire codec
    "sim.inputs": 58,  # traces, workloads, block keys, the future (no manager, no scheduler)
    "sim": 60,  # the run modes (replay, eviction replay, serve, memory study), cost model
    "sim.cluster": 62,  # N instances behind a router (above serve mode)
    "sim.report": 64,  # every mode's report, table and plot (reads the modes' results)
    "cli": 100,
    "__main__": 101,
}

# The core: these may import only the standard library and pagedkv at import time.
CORE = {
    "errors",
    "memory_guard",
    "block",
    "specs",
    "stats",
    "events",
    "free_queue",
    "hashing",
    "canonical_cbor",
    "credentials",
    "owner_thread",
    "atomic_file",
    "bounded_read",
    "request",
    "retention",
    "sizing",
    "eviction",
    "block_pool",
    "managers",
    "coordinators",
    "kv_cache_blocks",
    "kv_cache_manager",
    "__init__",
}

# Optional extras a core module may import lazily (inside a function), by module.
LAZY_EXTRAS: dict[str, set[str]] = {
    "hashing": {"cbor2", "xxhash"},
}

# Leaves must never reach these, whatever their ranks become.
ABOVE_LEAVES = {
    "block_pool",
    "managers",
    "coordinators",
    "kv_cache_manager",
    "sched",
    "sim",
    "cli",
}
LEAVES = {
    "errors",
    "owner_thread",
    "atomic_file",
    "bounded_read",
    "memory_guard",
    "block",
    "specs",
    "stats",
    "events",
    "free_queue",
    "hashing",
    "request",
}

STDLIB = set(sys.stdlib_module_names) | {"__future__"}


@dataclass(frozen=True)
class Import:
    module: str  # absolute dotted name as written (relative imports resolved)
    names: tuple[str, ...]  # for `from x import a, b`
    lineno: int
    lazy: bool  # inside a function
    type_only: bool  # inside `if TYPE_CHECKING:`


def layer_key(parts: Sequence[str]) -> str:
    """The LAYERS key of a module given as its parts under pagedkv (`("sim", "inputs",
    "traces")`): the longest dotted prefix that LAYERS places (a package's own rank when none
    of its subpackages has one), else the top-level name (which the test then reports)."""
    for end in range(len(parts), 1, -1):
        key = ".".join(parts[:end])
        if key in LAYERS:
            return key
    return parts[0]


def module_key(path: Path) -> str:
    """The LAYERS key of a file (a package's `__init__` counts as the package)."""
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return layer_key(parts)


def dotted_package(path: Path) -> list[str]:
    """The package a file's relative imports resolve against (its directory, dotted)."""
    return ["pagedkv", *path.relative_to(PACKAGE_DIR).parent.parts]


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def collect_imports(source: str, package: list[str]) -> list[Import]:
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool, type_only: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.append(Import(alias.name, (), node.lineno, lazy, type_only))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names = tuple(alias.name for alias in node.names)
            found.append(Import(module, names, node.lineno, lazy, type_only))
        for child in ast.iter_child_nodes(node):
            child_lazy = lazy or isinstance(
                node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda
            )
            child_type_only = type_only or (
                isinstance(node, ast.If) and is_type_checking(node.test) and child in node.body
            )
            visit(child, child_lazy, child_type_only)

    visit(ast.parse(source), False, False)
    return found


def pagedkv_targets(imp: Import) -> list[str]:
    """LAYERS keys an import reaches inside pagedkv (empty for other packages)."""
    parts = imp.module.split(".")
    if parts[0] != "pagedkv":
        return []
    if len(parts) == 1:
        # `import pagedkv` or `from pagedkv import x`: x is a submodule, or a name of the root.
        targets = []
        for name in imp.names or ("__init__",):
            is_module = (PACKAGE_DIR / f"{name}.py").exists() or (PACKAGE_DIR / name).is_dir()
            targets.append(name if is_module else "__init__")
        return targets
    # `from pagedkv.sim import replay`: each name that is a submodule counts as that module.
    package_dir = PACKAGE_DIR.joinpath(*parts[1:])
    targets = []
    for name in imp.names or ("",):
        is_module = name and (
            (package_dir / f"{name}.py").exists() or (package_dir / name).is_dir()
        )
        targets.append(layer_key([*parts[1:], name] if is_module else parts[1:]))
    return list(dict.fromkeys(targets))


def violations_of(key: str, imports: list[Import]) -> list[str]:
    """Every rule an import list of module `key` breaks, as readable strings.

    CORE, LEAVES, ABOVE_LEAVES and the CLI rule name top-level modules and packages; they
    cover every module inside a package (`block_pool.checks` is core, as `block_pool` is).
    """
    problems = []
    rank = LAYERS[key]
    package = key.split(".")[0]
    for imp in imports:
        top = imp.module.split(".")[0]
        if package in CORE and top != "pagedkv" and top not in STDLIB:
            if not (imp.lazy and top in LAZY_EXTRAS.get(key, set())):
                problems.append(f"line {imp.lineno}: core module imports {imp.module!r}")
        if package == "cli" and not imp.lazy and top != "pagedkv" and top not in STDLIB:
            problems.append(f"line {imp.lineno}: CLI imports {imp.module!r} at import time")
        if imp.type_only:
            continue
        for target in pagedkv_targets(imp):
            target_package = target.split(".")[0]
            if target not in LAYERS:
                problems.append(f"line {imp.lineno}: pagedkv.{target} is not placed in LAYERS")
            elif LAYERS[target] > rank:
                problems.append(
                    f"line {imp.lineno}: {key} (rank {rank}) imports {target} "
                    f"(rank {LAYERS[target]}): imports must point down"
                )
            if package in LEAVES and target_package in ABOVE_LEAVES:
                problems.append(f"line {imp.lineno}: leaf {key} imports {target}")
            if package == "managers" and target_package in {"coordinators", "kv_cache_manager"}:
                problems.append(f"line {imp.lineno}: managers import {target}")
    return problems


SOURCE_FILES = sorted(PACKAGE_DIR.rglob("*.py"))


def test_there_are_modules_to_check():
    keys = {module_key(path) for path in SOURCE_FILES}
    assert {"block", "block_pool", "managers", "coordinators", "kv_cache_manager"} <= keys


@pytest.mark.parametrize(
    "path", SOURCE_FILES, ids=[str(p.relative_to(PACKAGE_DIR)) for p in SOURCE_FILES]
)
def test_module_imports(path: Path):
    key = module_key(path)
    assert key in LAYERS, (
        f"pagedkv.{key} is not placed in the layer table: add it to LAYERS in tests/test_imports.py"
    )
    imports = collect_imports(path.read_text(), dotted_package(path))
    assert violations_of(key, imports) == []


def dotted_module(path: Path) -> str:
    """The dotted name of a source file (`pagedkv.wire.codec`; a package is its __init__)."""
    parts = path.relative_to(PACKAGE_DIR).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("pagedkv", *parts))


def module_graph() -> dict[str, set[str]]:
    """Module -> the pagedkv modules it imports, lazy and type-only imports included."""
    modules = {dotted_module(path): path for path in SOURCE_FILES}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for imp in collect_imports(path.read_text(), dotted_package(path)):
            targets = [f"{imp.module}.{n}" for n in imp.names if f"{imp.module}.{n}" in modules]
            if not targets and imp.module in modules:
                targets = [imp.module]
            graph[name].update(t for t in targets if t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path (first module repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return path[path.index(target) :] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles():
    # Lazy and TYPE_CHECKING imports count: a cycle hidden in a function is still a knot
    # (a factory belongs above the classes it picks; a leaf names a Protocol, not a class above).
    assert find_cycle(module_graph()) is None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# ---------------------------------------------------------------------------- the checker itself


def check(key: str, source: str, package=("pagedkv",)) -> list[str]:
    return violations_of(key, collect_imports(source, list(package)))


def test_checker_flags_upward_import():
    assert check("block", "from pagedkv.block_pool import BlockPool")
    assert check(
        "managers", "from pagedkv.kv_cache_manager import KVCacheManager", ("pagedkv", "managers")
    )
    assert check("kv_cache_manager", "import pagedkv.sched")
    assert check("hashing", "from pagedkv import KVCacheManager")  # the root is above leaves


def test_checker_flags_third_party_in_core():
    assert check("block_pool", "import numpy")
    assert check("hashing", "import xxhash")  # module level: not lazy
    assert check("block_pool", "def f():\n    import xxhash\n")  # not listed for block_pool
    assert check("hashing", "def f():\n    import xxhash\n") == []
    assert check("sim", "import matplotlib") == []  # outside the core


def test_checker_flags_unplaced_module_and_heavy_cli():
    assert check("sched", "from pagedkv.brand_new import x")
    assert check("cli", "import torch")
    assert check("cli", "def run(args):\n    import torch\n") == []


def test_checker_ranks_modules_inside_a_package():
    assert check("sim.inputs", "from pagedkv.sim.replay import replay", ("pagedkv", "sim"))
    assert check("sim.inputs", "from pagedkv.sim import serve", ("pagedkv", "sim", "inputs"))
    assert check("sim", "from pagedkv.sim.report import render_text", ("pagedkv", "sim"))
    assert check("block_pool.checks", "from pagedkv.block_pool.pool import BlockPool")
    assert check("sim.report", "from pagedkv.sim.inputs import load_trace") == []
    assert check("sim", "from pagedkv.sim import processes", ("pagedkv", "sim")) == []
    assert check("sim.cluster", "from pagedkv.sim.cluster.audit import RoutingAudit") == []
    assert module_key(PACKAGE_DIR / "sim" / "inputs" / "traces.py") == "sim.inputs"
    assert module_key(PACKAGE_DIR / "sim" / "inputs" / "__init__.py") == "sim.inputs"
    assert module_key(PACKAGE_DIR / "sim" / "serve.py") == "sim"


def test_checker_allows_downward_sideways_and_type_only():
    assert check("block_pool", "from pagedkv.hashing import BlockHasher") == []
    assert check("block", "from pagedkv.specs import cdiv") == []  # sideways between leaves
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pagedkv.request import R\n"
    )
    assert check("hashing", source) == []
    assert check("managers", "from .base import X", ("pagedkv", "managers")) == []
    assert check("sched", "from pagedkv import KVCacheManager") == []
