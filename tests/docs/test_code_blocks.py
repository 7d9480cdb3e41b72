"""Every code block of README.md, docs/*.md and examples/README.md runs as pasted (the rules
for writers: docs/contributing.md).

- `python` blocks run with pytest-examples, each in its own module; a `print(...)` is followed by
  its output as `#> ` lines, which must equal what it printed (`pytest tests/docs
  --update-examples` rewrites them).
- `bash` / `sh` blocks run as one `bash -euo pipefail` script; their `#> ` lines are the
  expected stdout of the whole block (`2>&1` shows an error), `...` matching anything.
- `console`, `text`, a bare fence and data formats (`toml`, `json`, ...) are shown, never run.
- A `python` or `bash` block whose first line is `# not run: REASON` is skipped with that reason.

Blocks run in a scratch folder that looks like a clone (each top-level entry of the repository
linked in), so relative paths work and the files a block writes land in the scratch folder;
commands see the tree under test first on PYTHONPATH and this interpreter's bin first on PATH,
with COLUMNS=80 and no terminal.
"""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.paths import REPO_DIR, SRC_DIR

pytest_examples = pytest.importorskip("pytest_examples")

DOC_FILES = sorted(
    [REPO_DIR / "README.md", *REPO_DIR.glob("docs/*.md"), *REPO_DIR.glob("examples/*.md")]
)
RUN_LANGUAGES = {"python", "py", "bash", "sh"}
SHOWN_LANGUAGES = {"", "console", "text", "toml", "json", "jsonl", "yaml", "ini", "diff", "mermaid"}
NOT_RUN = re.compile(r"^\s*# not run: (?P<reason>\S.*)$")
OUTPUT_PREFIX = "#> "
SHELL_TIMEOUT_S = 300
# Entries of the clone that the scratch folder does not link: git's, and environments we build.
NOT_LINKED = {".git", ".venv", ".vllm-ci", "site", ".pytest_cache", ".mypy_cache", ".ruff_cache"}

FENCE = re.compile(
    r"^(?P<indent> *)```(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language (the info string's first word) and body."""

    path: Path
    line: int
    language: str
    body: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO_DIR)}:{self.line}"


def find_blocks(path: Path) -> list[Block]:
    text = path.read_text(encoding="utf-8")
    blocks = []
    for match in FENCE.finditer(text):
        info = match.group("info").strip()
        language = info.split()[0].lower() if info else ""
        body = "\n".join(
            line[len(match.group("indent")) :] for line in match.group("body").splitlines()
        )
        line = text.count("\n", 0, match.start()) + 1
        blocks.append(Block(path, line, language, body + "\n"))
    return blocks


ALL_BLOCKS = [block for path in DOC_FILES for block in find_blocks(path)]
SHELL_BLOCKS = [block for block in ALL_BLOCKS if block.language in {"bash", "sh"}]
PYTHON_EXAMPLES = list(pytest_examples.find_examples(*DOC_FILES))


def not_run_reason(source: str) -> str | None:
    first = source.lstrip("\n").split("\n", 1)[0]
    match = NOT_RUN.match(first)
    return match.group("reason") if match else None


@pytest.fixture(scope="module")
def clone_view(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A scratch folder with every top-level entry of the repository linked in."""
    view = tmp_path_factory.mktemp("clone")
    for entry in REPO_DIR.iterdir():
        if entry.name not in NOT_LINKED:
            (view / entry.name).symlink_to(entry)
    return view


def block_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["COLUMNS"] = "80"
    env.pop("FORCE_COLOR", None)
    env["NO_COLOR"] = "1"
    return env


def test_docs_have_runnable_blocks():
    assert len(PYTHON_EXAMPLES) >= 3, [str(example) for example in PYTHON_EXAMPLES]
    assert len(SHELL_BLOCKS) >= 2, [block.name for block in SHELL_BLOCKS]


@pytest.mark.parametrize("block", ALL_BLOCKS, ids=lambda block: block.name)
def test_block_language_is_known(block: Block):
    """A fence names a language that runs or one that is shown (a typo hides no block)."""
    known = RUN_LANGUAGES | SHOWN_LANGUAGES
    assert block.language in known, (
        f"{block.name}: fence language {block.language!r} is neither run ({sorted(RUN_LANGUAGES)})"
        f" nor shown ({sorted(SHOWN_LANGUAGES - {''})}); see docs/contributing.md"
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize("example", PYTHON_EXAMPLES, ids=str)
def test_python_block(example, eval_example, clone_view: Path, monkeypatch: pytest.MonkeyPatch):
    if reason := not_run_reason(example.source):
        pytest.skip(f"not run: {reason}")
    monkeypatch.chdir(clone_view)
    eval_example.set_config(line_length=100)
    failure = None
    try:
        if eval_example.update_examples:
            eval_example.run_print_update(example)
        else:
            eval_example.run_print_check(example)
    except Exception as exc:  # noqa: BLE001 - reported below, as one clean failure
        # pytest-examples points the traceback at the block's lines with synthetic frames that
        # pytest cannot summarise on Python 3.11 (an INTERNALERROR instead of the failure).
        failure = f"{example}: {''.join(traceback.format_exception_only(exc)).strip()}"
        failure += f"\n{_where(exc, example)}"
    if failure is not None:
        pytest.fail(failure, pytrace=False)


def _where(exc: BaseException, example) -> str:
    """`FILE:LINE: source` of the block's line the exception came from (pytest-examples numbers
    the frames by the Markdown file's lines)."""
    lines = example.source.splitlines()
    tb, line_no = exc.__traceback__, None
    while tb is not None:
        if str(example.path) in tb.tb_frame.f_code.co_filename:
            line_no = tb.tb_lineno
        tb = tb.tb_next
    index = -1 if line_no is None else line_no - example.start_line - 1
    if not 0 <= index < len(lines):
        return ""
    return f"{example.path.name}:{line_no}: {lines[index].strip()}"


def split_expected_output(body: str) -> tuple[str, str | None]:
    """The script without its `#> ` lines, and those lines' text (None if there are none)."""
    script, expected = [], []
    for line in body.splitlines():
        stripped = line.lstrip()
        if stripped.startswith(OUTPUT_PREFIX) or stripped == OUTPUT_PREFIX.rstrip():
            expected.append(stripped[len(OUTPUT_PREFIX) :])
        else:
            script.append(line)
    return "\n".join(script) + "\n", ("\n".join(expected) + "\n" if expected else None)


def output_matches(expected: str, got: str) -> bool:
    """Equal line by line (trailing blanks ignored), `...` matching any text, lines included."""
    normalize = lambda text: "\n".join(line.rstrip() for line in text.strip("\n").splitlines())  # noqa: E731
    return doctest.OutputChecker().check_output(
        normalize(expected) + "\n", normalize(got) + "\n", doctest.ELLIPSIS
    )


@pytest.mark.timeout(SHELL_TIMEOUT_S + 30)
@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda block: block.name)
def test_shell_block(block: Block, clone_view: Path):
    if reason := not_run_reason(block.body):
        pytest.skip(f"not run: {reason}")
    script, expected = split_expected_output(block.body)
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=clone_view,
        env=block_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=SHELL_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{block.name} exited {result.returncode}:\n{result.stdout}{result.stderr}"
    )
    if expected is not None:
        assert output_matches(expected, result.stdout), (
            f"{block.name}: the output differs from the block's `#> ` lines.\n"
            f"--- shown\n{expected}--- printed\n{result.stdout}--- stderr\n{result.stderr}"
        )


@pytest.mark.parametrize(
    ("expected", "got", "matches"),
    [
        ("a\nb\n", "a  \nb\n", True),
        ("a ... c\n", "a b c\n", True),
        ("first\n...\nlast\n", "first\nx\ny\nlast\n", True),
        ("a\nb\n", "a\nc\n", False),
        ("12,345\n", "12,346\n", False),
    ],
)
def test_output_matching(expected: str, got: str, matches: bool):
    assert output_matches(expected, got) is matches


def test_expected_output_is_split_from_the_script():
    script, expected = split_expected_output("echo hi\n#> hi\necho 'x'\n#>\n#> x\n")
    assert script == "echo hi\necho 'x'\n"
    assert expected == "hi\n\nx\n"
    assert split_expected_output("true\n") == ("true\n", None)


def test_not_run_marker():
    assert not_run_reason("# not run: needs a GPU\nimport torch\n") == "needs a GPU"
    assert not_run_reason("import torch  # not run: no\n") is None
