"""`pagedkv simulate`: Ctrl-C as a request to stop a long simulation and report what it measured.

Standard library only.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType, TracebackType
from typing import Any


class StopOnCtrlC:
    """While active, the first Ctrl-C asks the run to stop (the run polls `stop()` between
    steps, then reports what it measured); a second one aborts at once (KeyboardInterrupt).

    Outside the main thread, where no signal handler can be set, it never asks to stop.
    """

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None

    def __call__(self) -> bool:
        return self.requested

    def __enter__(self) -> StopOnCtrlC:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nstopping: the report covers what was measured so far (Ctrl-C again to abort)",
            file=sys.stderr,
            flush=True,
        )
