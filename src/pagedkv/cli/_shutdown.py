"""CLI helper: one shutdown path for SIGINT (Ctrl-C), SIGTERM and SIGHUP, and the exit codes of
the CLI's endings by signal (a broken pipe included). Standard library only.

Every command runs under `raise_on_signals()`: any of the three raises `Shutdown` (a
`KeyboardInterrupt`, so every `finally` and `except BaseException` clean-up runs: worker pools
are terminated, Redis namespaces dropped) and `pagedkv.cli.main` exits 128 + the signal's
number. A long simulation that can report what it measured so far runs under `StopOnSignal`:
the first signal asks it to stop (it polls between steps, then reports), a second aborts.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any

SHUTDOWN_SIGNALS: tuple[signal.Signals, ...] = tuple(
    getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
)
# The shell's convention for an ending by signal N is 128 + N; a broken pipe (the reader of
# stdout went away, `| head`) is SIGPIPE's, 141, however the write failed.
SIGNAL_EXIT_BASE = 128
BROKEN_PIPE_EXIT = SIGNAL_EXIT_BASE + getattr(signal, "SIGPIPE", 13)


class Shutdown(KeyboardInterrupt):
    """One of `SHUTDOWN_SIGNALS` arrived; `signum` says which."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def exit_code(interrupt: KeyboardInterrupt) -> int:
    """128 + the signal that ended the command (a bare KeyboardInterrupt: SIGINT's 130)."""
    return SIGNAL_EXIT_BASE + getattr(interrupt, "signum", signal.SIGINT)


def interrupted(exc: KeyboardInterrupt) -> str:
    """`interrupted` (Ctrl-C) or `interrupted (SIGTERM)`: what the CLI says on stderr."""
    signum = getattr(exc, "signum", signal.SIGINT)
    return "interrupted" if signum == signal.SIGINT else f"interrupted ({signal_name(signum)})"


def _installable(signum: int) -> bool:
    """Handlers can be set here (main thread) and the signal is not ignored: a process started
    under `nohup`, or in the background by a script, keeps ignoring what it was told to."""
    if threading.current_thread() is not threading.main_thread():
        return False
    return signal.getsignal(signum) is not signal.SIG_IGN


@contextmanager
def raise_on_signals() -> Iterator[None]:
    """While active, SIGINT, SIGTERM and SIGHUP raise `Shutdown` in the main thread (outside
    it, or for a signal ignored at start, nothing changes); the previous handlers come back
    afterwards.

    A signal handler's exception is lost where it lands in code whose exceptions the
    interpreter only reports (an at-fork hook, a `__del__`, a weakref callback): such a
    `Shutdown` is kept instead, and raised when the block ends. (One a command catches on
    purpose, as `events listen` ends on Ctrl-C, stays caught.)
    """
    lost: list[BaseException] = []
    report_unraisable = sys.unraisablehook

    def keep_lost_shutdown(unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, Shutdown):
            lost.append(unraisable.exc_value)
        else:
            report_unraisable(unraisable)

    previous: dict[int, Any] = {}
    for signum in SHUTDOWN_SIGNALS:
        if _installable(signum):
            previous[signum] = signal.signal(signum, _raise_shutdown)
    sys.unraisablehook = keep_lost_shutdown
    try:
        yield
    except KeyboardInterrupt:
        raise
    else:
        if lost:
            raise lost[-1]
    finally:
        sys.unraisablehook = report_unraisable
        for restored, handler in previous.items():
            signal.signal(restored, handler)


def _raise_shutdown(signum: int, frame: FrameType | None) -> None:
    raise Shutdown(signum)


class StopOnSignal:
    """While active, the first of SIGINT, SIGTERM or SIGHUP asks the run to stop (the run polls
    `stop()` between steps, then reports what it measured); a second one aborts at once
    (`Shutdown`). `signum` is the signal that asked, None while none has.

    Outside the main thread, where no signal handler can be set, it never asks to stop.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def __call__(self) -> bool:
        return self.signum is not None

    def exit_code(self) -> int:
        """128 + the signal that stopped the run; 0 if none did."""
        return 0 if self.signum is None else SIGNAL_EXIT_BASE + self.signum

    def __enter__(self) -> StopOnSignal:
        for signum in SHUTDOWN_SIGNALS:
            if _installable(signum):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            raise Shutdown(signum)
        self.signum = signum
        again = "Ctrl-C" if signum == signal.SIGINT else signal_name(signum)
        say(f"\nstopping: the report covers what was measured so far ({again} again to abort)")


def say(message: str) -> None:
    """Print to stderr, or nothing where stderr is gone (a closed terminal: SIGHUP's case).

    An error raised here would surface wherever the main thread happened to be.
    """
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # ValueError: stderr already closed
        pass
