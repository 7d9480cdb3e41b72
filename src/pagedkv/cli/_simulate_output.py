"""`pagedkv simulate`'s terminal output: the report table, the profile list and the progress bar.

rich is imported lazily (a plain-text table and no bar without it); imports only the standard
library at module level.
"""

from __future__ import annotations

import sys
import time
from typing import Any

PROGRESS_DELAY_S = 1.0
_UNWRAPPED_WIDTH = 500  # columns rich may use when stdout is no terminal


def print_table(report_module: Any, the_report: dict, speed: Any) -> None:
    try:
        from rich.console import Console
    except ImportError:
        encoding = (getattr(sys.stdout, "encoding", None) or "").lower()
        ascii_only = "utf" not in encoding
        sys.stdout.write(report_module.render_text(the_report, speed, ascii_only=ascii_only))
        return
    # Piped or redirected: no terminal width to fit, so never wrap (rich would assume 80).
    width = None if sys.stdout.isatty() else _UNWRAPPED_WIDTH
    report_module.render_rich(the_report, speed, Console(width=width))


def print_profiles(cost_model: Any) -> None:
    for name, profile in sorted(cost_model.PROFILES.items()):
        model = profile.cost_model()
        print(f"{name}: {profile.description}")
        print(
            f"  KV {profile.kv_bytes_per_token:,} bytes/token, "
            f"{profile.num_kv_blocks(16) * 16:,} KV tokens, max_model_len {profile.max_model_len:,}"
        )
        print(
            f"  step_overhead_s={model.step_overhead_s:.4g} prefill_token_s="
            f"{model.prefill_token_s:.4g} decode_seq_s={model.decode_seq_s:.4g} "
            f"kv_token_read_s={model.kv_token_read_s:.4g} "
            f"prefill_attention_pair_s={model.prefill_attention_pair_s:.4g}"
        )


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
                from rich.console import Console
                from rich.progress import Progress
            except ImportError:
                self.enabled = False
                return
            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task(self.label, total=self.total, completed=num_done)
            self.bar.start()
            return
        self.bar.update(self.task, completed=num_done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
