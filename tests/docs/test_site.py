"""The docs site (mkdocs.yml: MkDocs, Material, mkdocstrings) builds with --strict: a link to a
missing page or anchor, or a page left out of the nav, fails it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import REPO_DIR, SRC_DIR


def build(config: Path, site_dir: Path) -> subprocess.CompletedProcess[str]:
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):  # the [docs] extra
        pytest.importorskip(module)
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(SRC_DIR)}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(config),
            "-d",
            str(site_dir),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


@pytest.mark.timeout(330)
def test_the_site_builds_strict_with_the_api_reference(tmp_path):
    result = build(REPO_DIR / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text(encoding="utf-8")
    assert "allocate_slots" in api and "get_computed_blocks" in api  # mkdocstrings rendered it
    pages = {path.stem for path in (REPO_DIR / "docs").glob("*.md")}
    built = {path.parent.name for path in (tmp_path / "site").glob("*/index.html")}
    assert pages - {"index"} <= built  # every doc is a page of the site


@pytest.mark.timeout(330)
def test_a_broken_link_fails_the_build(tmp_path):
    shutil.copytree(REPO_DIR / "docs", tmp_path / "docs")
    shutil.copy(REPO_DIR / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "index.md", "a", encoding="utf-8") as file:
        file.write("\n[gone](design.md#no-such-section)\n")
    (tmp_path / "src").symlink_to(SRC_DIR)  # mkdocstrings' `paths: [src]`
    result = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 1
    assert "does not contain an anchor '#no-such-section'" in result.stderr


def test_the_docs_index_lists_every_doc():
    """(README.md's Documentation list is kept by its one editor; the index by everyone.)"""
    index = (REPO_DIR / "docs" / "index.md").read_text(encoding="utf-8")
    for path in sorted((REPO_DIR / "docs").glob("*.md")):
        if path.name != "index.md":
            assert f"({path.name})" in index, f"docs/index.md misses {path.name}"
