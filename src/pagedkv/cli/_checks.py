"""CLI helper: argument types and the checks every command shares, run before any long work.

Each check raises a `PagedKVError` naming the flag and the bad value, so `pagedkv.cli.main`
prints one line. Standard library only at import time; an extra is imported only to see that
it is there.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path

# Python modules each optional feature needs, and the extra that installs them.
_EXTRA_MODULES = {
    "events": ("zmq", "msgspec"),
    "hashing": ("cbor2", "xxhash"),
    "metrics": ("prometheus_client",),
    "sim": ("matplotlib",),
}
_MODULE_TO_PACKAGE = {"zmq": "pyzmq", "prometheus_client": "prometheus-client"}


# ---------------------------------------------------------------------------- argument types


def int_at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: an int in [minimum, maximum], or a one-line usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum or (maximum is not None and value > maximum):
            bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = "int"  # argparse names the type in its messages
    return parse


def float_in(
    minimum: float, maximum: float | None = None, *, open_minimum: bool = False
) -> Callable[[str], float]:
    """An argparse type: a finite float above `minimum` (or at it, unless `open_minimum`) and
    below `maximum` (exclusive)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > minimum if open_minimum else value >= minimum
        if not (math.isfinite(value) and low_ok and (maximum is None or value < maximum)):
            low = f"> {minimum:g}" if open_minimum else f">= {minimum:g}"
            bound = low if maximum is None else f"{low} and < {maximum:g}"
            raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


# ---------------------------------------------------------------------------- checks


def require_extra(extra: str, feature: str) -> None:
    """Raise `MissingDependencyError` unless every module of `extra` can be imported."""
    from pagedkv.errors import MissingDependencyError, install_hint

    missing = [name for name in _EXTRA_MODULES[extra] if not _importable(name)]
    if missing:
        raise MissingDependencyError(
            f"{feature} needs {', '.join(_MODULE_TO_PACKAGE.get(m, m) for m in missing)} "
            f"(the [{extra}] extra): "
            f"{install_hint(extra)}"
        )


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules, a broken parent
        return False


def check_hash_algorithm(name: str) -> None:
    """The extra a prefix-cache hash algorithm needs is installed."""
    if name == "sha256_cbor":
        require_extra("hashing", "--hash-algorithm sha256_cbor")
    elif name == "xxh3_128":
        require_extra("hashing", "--hash-algorithm xxh3_128")


def check_output_file(flag: str, path_text: str, suffixes: Iterable[str] | None = None) -> Path:
    """`path_text` names a file that can be written (its directory exists and is writable, it is
    no directory) with one of `suffixes`, when given. Returns it as a Path."""
    from pagedkv.errors import InvalidArgumentError

    path = Path(path_text)
    if path.is_dir():
        raise InvalidArgumentError(f"{flag} {path_text}: is a directory; name a file in it")
    if suffixes is not None:
        known = sorted(suffixes)
        suffix = path.suffix.lower().removeprefix(".")
        if not suffix:
            raise InvalidArgumentError(
                f"{flag} {path_text}: no extension to choose the format by; use one of "
                f"{', '.join('.' + s for s in known)}"
            )
        if suffix not in known:
            raise InvalidArgumentError(
                f"{flag} {path_text}: unknown format .{suffix}; use one of "
                f"{', '.join('.' + s for s in known)}"
            )
    directory = path.parent
    if not directory.is_dir():
        raise InvalidArgumentError(f"{flag} {path_text}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InvalidArgumentError(f"{flag} {path_text}: not writable")
    return path


def check_plot_file(path_text: str) -> Path:
    """`--plot`: matplotlib is installed and can write that file's format."""
    require_extra("sim", "--plot")
    from matplotlib.backend_bases import FigureCanvasBase

    return check_output_file("--plot", path_text, FigureCanvasBase.get_supported_filetypes())


def examples_epilog(*commands: str) -> str:
    """The "examples:" block at the end of a command's --help (shown as written)."""
    return "examples:\n" + "\n".join(f"  {command}" for command in commands)
