"""CLI: `pagedkv simulate`, replay a request trace through the scheduler and the manager.

`command` parses, checks and calls the simulator's modes; `args` defines the options, `checks`
refuses bad ones before any work, `cluster`, `eviction` and `memory` hold their modes' options
and calls, `progress` the progress bar (Ctrl-C, SIGTERM and SIGHUP: `pagedkv.cli._shutdown`).
Reports and their rendering live in `pagedkv.sim.report`. Standard library only at import time.
"""

from pagedkv.cli.simulate.command import (
    COMMAND,
    EXAMPLES,
    HELP,
    SAMPLE_TRACE,
    add_arguments,
    run,
)

__all__ = ["COMMAND", "EXAMPLES", "HELP", "SAMPLE_TRACE", "add_arguments", "run"]
