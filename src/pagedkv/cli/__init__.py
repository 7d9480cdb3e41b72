"""CLI: `pagedkv <command>`. Thin layer; each command lives in its own module of this package
(or its own subpackage, as `simulate/` does; `_checks` holds the argument types they share).

A command module defines `COMMAND` (its name), `HELP` (one line), `EXAMPLES` (command lines
shown at the end of its --help), `add_arguments(parser)` and
`run(args) -> int`, and imports only the standard library at module level (heavy optional
imports go inside `run`), so `pagedkv --help` stays fast and works without extras.

A user's mistake never ends in a traceback: a bad argument, a `PagedKVError` or an `OSError`
prints one line `pagedkv COMMAND: error: ...` and exits 2. Signals end every command the same
way (`_shutdown`): SIGINT (Ctrl-C), SIGTERM and SIGHUP run the clean-ups and exit 128 + the
signal (130, 143, 129); a broken pipe (`| head`) stops quietly with 141, SIGPIPE's code.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from pagedkv.cli._checks import examples_epilog
from pagedkv.cli._shutdown import BROKEN_PIPE_EXIT, exit_code, interrupted, raise_on_signals, say
from pagedkv.credentials import redact
from pagedkv.errors import PagedKVError


def _command_modules() -> list:
    package = sys.modules[__name__]
    modules = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "COMMAND"):
            modules.append(module)
    return modules


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (argparse prints the whole usage block first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {redact(message)} (see {self.prog} --help)\n")

    def _print_message(self, message: str, file: Any = None) -> None:
        # argparse swallows every OSError here; a broken pipe must reach `main` (exit 141).
        if message:
            (file or sys.stderr).write(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="pagedkv",
        description="Paged KV-cache manager: simulate, size, observe.",
    )
    from pagedkv import __version__

    parser.add_argument("--version", action="version", version=f"pagedkv {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _command_modules():
        sub = subparsers.add_parser(
            module.COMMAND,
            help=module.HELP,
            description=module.HELP,
            epilog=examples_epilog(*module.EXAMPLES),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    command = parser.prog
    try:
        with raise_on_signals():
            try:
                args = parser.parse_args(argv)
            except SystemExit as exc:  # a usage error (printed already), --help or --version
                return exc.code if isinstance(exc.code, int) else 2
            if not getattr(args, "_run", None):
                parser.print_help()
                return 2
            command = f"{parser.prog} {args.command}"
            return int(args._run(args) or 0)
    except KeyboardInterrupt as exc:  # Ctrl-C, SIGTERM or SIGHUP: the clean-ups have run
        say(f"\n{command}: {interrupted(exc)}")
        return exit_code(exc)
    except BrokenPipeError:
        # The reader (`| head`) went away: stop quietly, with SIGPIPE's code, as Unix tools do.
        _silence_stdout()
        return BROKEN_PIPE_EXIT
    except (PagedKVError, OSError) as exc:
        print(f"{command}: error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{command}: error: out of memory", file=sys.stderr)
        return 1


def _silence_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is still buffered
    raises nothing (it would print "Exception ignored ... BrokenPipeError" and exit 120)."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real stdout (an embedding, a test's capture)
        pass
