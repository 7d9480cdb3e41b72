"""`pagedkv simulate`'s progress bar on stderr (the report's table is `pagedkv.sim.report`'s).

rich is imported lazily (no bar without it); imports only the standard library at module level.
"""

from __future__ import annotations

import time
from typing import Any

PROGRESS_DELAY_S = 1.0


class Progress:
    """A rich progress bar on stderr, shown only once a run has lasted `PROGRESS_DELAY_S`."""

    def __init__(self, total: int, label: str, enabled: bool) -> None:
        self.total = total
        self.label = label
        self.enabled = enabled
        self.start = time.monotonic()
        self.last_check = self.start
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, num_done: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        # Hot path: called per request; look at the clock at most ten times a second.
        if now - self.last_check < 0.1:
            return
        self.last_check = now
        if self.bar is None:
            if now - self.start < PROGRESS_DELAY_S:
                return
            try:
                from rich.progress import Progress
            except ImportError:
                self.enabled = False
                return
            from pagedkv.sim.report.render import pipe_safe_console

            self.bar = Progress(console=pipe_safe_console(stderr=True), transient=True)
            self.task = self.bar.add_task(self.label, total=self.total, completed=num_done)
            self.bar.start()
            return
        self.bar.update(self.task, completed=num_done)

    def close(self) -> None:
        if self.bar is not None:
            bar, self.bar = self.bar, None
            try:
                bar.stop()
            except Exception:  # noqa: BLE001 - see below
                # A signal that ended the run inside rich's own start or refresh leaves the bar
                # half set up, and its stop then fails; the run's own ending matters, not this.
                pass
